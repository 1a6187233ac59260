"""AttentionEntropyMonitor: one Lightning callback from attention to dashboards.

    trainer = L.Trainer(callbacks=[AttentionEntropyMonitor()], logger=...)

On a fixed sample of validation batches (the same batches every epoch, so
epochs compare like with like) it records per-query attention entropy with
:class:`~attn_monitor.capture.AttentionCapture`; at the end of the validation
epoch every rank computes the summary (a collective), rank zero logs it, and
the metric is reset. Everything else runs at full speed: the capture's hooks
pass straight through outside sampled batches.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn
from typing_extensions import override

from attn_monitor.capture import (
    Adapter,
    AttentionCall,
    AttentionCapture,
    _matches,
    default_document_ids,
    default_padding_mask,
    nothing_captured_message,
)
from attn_monitor.compare import save_summary
from attn_monitor.diagnostics import MassDiagnostics
from attn_monitor.logging import WANDB_MAX_BINS, log_summary, logger_kind
from attn_monitor.metric import AttentionEntropy, AttentionMass, EntropySummary, MassSummary

__all__ = ["AttentionEntropyMonitor"]

BatchMask = Callable[[Any], "Tensor | None"]

#: Mean leakage above this (per layer) means packed documents see each other.
LEAKAGE_TOLERANCE = 1e-4


def _check_int(name: str, value: object, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"Expected `{name}` to be an int, got {type(value).__name__} {value!r}.")
    if value < minimum:
        raise ValueError(f"Expected `{name}` >= {minimum}, got {value}.")
    return value


class AttentionEntropyMonitor(Callback):
    """Log per-layer, per-head attention entropy on sampled validation batches.

    Args:
        batches: which validation batches of each dataloader to monitor: an int
            ``n`` (the first ``n``, or ``n`` drawn at random with
            ``random_sample``) or explicit batch indices.
        random_sample: draw ``batches`` indices at random over the epoch, with
            ``seed``; the draw is made once and reused every epoch.
        seed: seed of the random draw.
        every_n_epochs: monitor every n-th validation run.
        skip_sanity_check: leave out the sanity-check validation run.
        train_every_n_steps: also record one training step every n steps and
            log it under ``{prefix}_train`` (None: off).
        padding_mask: ``padding_mask(batch) -> (batch, seq)`` mask of real
            tokens; by default a dict batch's ``attention_mask``. Queries
            outside it are not samples.
        module: ``module(pl_module) -> nn.Module`` to watch; by default the
            LightningModule itself (layer names are relative to it).
        layers: layer name patterns (globs) to monitor; each must match a
            module at setup.
        adapters: module name pattern -> adapter, see :class:`AttentionCapture`.
        per_head: log per-head mean and median.
        quantiles: quantile levels logged per layer, each in [0, 1].
        histogram_bins: bins of the logged histograms (None: no histograms);
            at most 512 when a W&B logger is attached.
        heatmap: log the layer x head median heatmap.
        prefix: first component of every logged name.
        include_single_key: count one-key queries (see :class:`AttentionEntropy`).
        sink_tokens: log the attention-sink mass on the first ``sink_tokens``
            real tokens of each sequence (document) as ``attn_sink_mass/...``.
        eviction: (sink_tokens, window) KV-cache policies whose kept mass is
            logged as ``attn_coverage_s{s}_w{w}/...``.
        leakage: log cross-document leakage (``attn_leakage/...``) and warn
            once, naming the layers, when a packed batch's documents are not
            isolated by the model's mask. Needs ``document_ids``.
        document_ids: ``document_ids(batch) -> (batch, seq)`` document of
            each token; by default a dict batch's ``document_ids``.
        collapse_threshold: flag heads whose median normalised entropy falls
            below this value.
        collapse_drop: flag heads whose median fell by more than this
            fraction of its value at the first monitored epoch.
        stop_on_collapse: ask the trainer to stop when a head is flagged
            (default: warn and log only).
        save_summaries: save each epoch's summary (see
            :func:`~attn_monitor.compare.save_summary`) under
            ``{trainer.log_dir}/attn_entropy/epoch{n}.pt``.

    Raises:
        TypeError, ValueError: bad configuration, at construction; patterns
            that match nothing and too many bins for W&B, at setup.

    Example:
        >>> monitor = AttentionEntropyMonitor(batches=4, every_n_epochs=2)
        >>> monitor.quantiles
        (0.05, 0.25, 0.5, 0.75, 0.95)
    """

    def __init__(
        self,
        *,
        batches: int | Sequence[int] = 2,
        random_sample: bool = False,
        seed: int = 0,
        every_n_epochs: int = 1,
        skip_sanity_check: bool = True,
        train_every_n_steps: int | None = None,
        padding_mask: BatchMask | None = None,
        module: Callable[[pl.LightningModule], nn.Module] | None = None,
        layers: Sequence[str] | None = None,
        adapters: Mapping[str, Adapter] | None = None,
        per_head: bool = True,
        quantiles: Sequence[float] = (0.05, 0.25, 0.5, 0.75, 0.95),
        histogram_bins: int | None = 100,
        heatmap: bool = True,
        prefix: str = "attn_entropy",
        include_single_key: bool = False,
        sink_tokens: int | None = None,
        eviction: Sequence[tuple[int, int]] = (),
        leakage: bool = False,
        document_ids: BatchMask | None = None,
        collapse_threshold: float | None = None,
        collapse_drop: float | None = None,
        stop_on_collapse: bool = False,
        save_summaries: bool = False,
    ) -> None:
        super().__init__()
        if isinstance(batches, int):
            _check_int("batches", batches, 0)
            self.indices: tuple[int, ...] | None = None
        else:
            indices = tuple(batches)
            for index in indices:
                _check_int("batches", index, 0)
            if random_sample:
                raise ValueError("`random_sample` draws a count of batches; pass `batches` as an int with it.")
            self.indices = tuple(sorted(set(indices)))
        self.batches = batches
        self.random_sample = bool(random_sample)
        self.seed = _check_int("seed", seed, 0)
        self.every_n_epochs = _check_int("every_n_epochs", every_n_epochs, 1)
        self.skip_sanity_check = bool(skip_sanity_check)
        self.train_every_n_steps = (
            None if train_every_n_steps is None else _check_int("train_every_n_steps", train_every_n_steps, 1)
        )
        if padding_mask is not None and not callable(padding_mask):
            raise TypeError(f"Expected `padding_mask` to be callable, got {type(padding_mask).__name__}.")
        if module is not None and not callable(module):
            raise TypeError(f"Expected `module` to be callable, got {type(module).__name__}.")
        self.padding_mask = padding_mask or default_padding_mask
        self.module = module
        if isinstance(layers, str):
            raise TypeError(f"Expected `layers` to be a sequence of patterns, got the string {layers!r}.")
        self.layers = None if layers is None else list(layers)
        self.adapters = dict(adapters or {})
        self.per_head = bool(per_head)
        self.quantiles = tuple(float(q) for q in quantiles)
        for q in self.quantiles:
            if not 0.0 <= q <= 1.0:
                raise ValueError(f"Expected every quantile level in [0, 1], got {q}.")
        if histogram_bins is not None:
            _check_int("histogram_bins", histogram_bins, 1)
        self.histogram_bins = histogram_bins
        self.heatmap = bool(heatmap)
        if not isinstance(prefix, str) or not prefix or prefix.endswith("/"):
            raise ValueError(f"Expected `prefix` to be a non-empty name without a trailing '/', got {prefix!r}.")
        self.prefix = prefix
        self.include_single_key = bool(include_single_key)
        self.diagnostics = MassDiagnostics(sink_tokens=sink_tokens, eviction=eviction, leakage=leakage)
        if document_ids is not None and not callable(document_ids):
            raise TypeError(f"Expected `document_ids` to be callable, got {type(document_ids).__name__}.")
        self.document_ids = document_ids or default_document_ids
        for name, value in (("collapse_threshold", collapse_threshold), ("collapse_drop", collapse_drop)):
            if value is not None and not 0.0 <= value <= 1.0:
                raise ValueError(f"Expected `{name}` in [0, 1] or None, got {value!r}.")
        self.collapse_threshold = collapse_threshold
        self.collapse_drop = collapse_drop
        self.stop_on_collapse = bool(stop_on_collapse)
        self.save_summaries = bool(save_summaries)
        self._first_medians: Tensor | None = None
        self._flagged: set[tuple[str, int]] = set()
        self._leaky_warned = False

        self.capture: AttentionCapture | None = None
        self._train_metric: AttentionEntropy | None = None
        self._val_metric: AttentionEntropy | None = None
        self._drawn: dict[int, tuple[int, ...]] = {}
        self._monitoring_epoch = False
        self._training_step_recorded = False
        self._last_train_step = -1
        self._recording = ExitStack()
        self.last_summary: EntropySummary | None = None

    # -- set-up and clean-up -----------------------------------------------
    def _new_metric(self) -> AttentionEntropy:
        # Metric bins: a multiple of the logged bins, and fine enough for quantiles to 0.001.
        bins = self.histogram_bins or 1000
        return AttentionEntropy(num_bins=bins * -(-1000 // bins), include_single_key=self.include_single_key)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.capture is not None:
            return
        if self.histogram_bins and self.histogram_bins > WANDB_MAX_BINS:
            wandb_loggers = [logger for logger in trainer.loggers if logger_kind(logger) == "wandb"]
            if wandb_loggers:
                raise ValueError(
                    f"`histogram_bins`={self.histogram_bins} but W&B keeps at most {WANDB_MAX_BINS} bins "
                    "and silently drops the rest; pass histogram_bins <= 512."
                )
        model = self.module(pl_module) if self.module is not None else pl_module
        if not isinstance(model, nn.Module):
            raise TypeError(f"Expected `module(pl_module)` to return an nn.Module, got {type(model).__name__}.")
        if self.layers is not None:
            names = [name for name, _ in model.named_modules() if name]
            unmatched = [p for p in self.layers if not any(_matches(name, p) for name in names)]
            if unmatched:
                raise ValueError(f"Layer patterns {unmatched} match no module of {type(model).__name__}.")
        self._val_metric = self._new_metric().to(pl_module.device)
        self._train_metric = self._new_metric().to(pl_module.device)
        self.capture = AttentionCapture(model, self._val_metric, layers=self.layers, adapters=self.adapters)
        if self.diagnostics.enabled:
            self.diagnostics.metric = AttentionMass().to(pl_module.device)
            self.capture.consumers.append(self._diagnose)
        self.capture.attach()

    def _diagnose(self, call: AttentionCall, sample: Tensor) -> None:
        # Mass diagnostics describe the sampled validation batches only.
        if self.capture is not None and self.capture.metric is self._val_metric:
            self.diagnostics(call, sample)

    def _release(self) -> None:
        self._recording.close()
        if self.capture is not None:
            self.capture.detach()
            self.capture = None

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._release()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._release()

    # -- which batches -----------------------------------------------------
    def sampled_indices(self, num_batches: int | float, dataloader_idx: int = 0) -> tuple[int, ...]:
        """Batch indices monitored in a validation dataloader of ``num_batches`` batches."""
        if self.indices is not None:
            return self.indices
        count = int(self.batches)  # type: ignore[arg-type]
        if not self.random_sample:
            return tuple(range(count))
        if dataloader_idx not in self._drawn:
            if num_batches == float("inf"):
                raise ValueError("`random_sample` needs a validation dataloader of known length.")
            population = range(int(num_batches))
            drawn = random.Random(self.seed + dataloader_idx).sample(population, min(count, len(population)))
            self._drawn[dataloader_idx] = tuple(sorted(drawn))
        return self._drawn[dataloader_idx]

    # -- validation --------------------------------------------------------
    @override
    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        sanity = trainer.sanity_checking
        self._monitoring_epoch = (
            self.capture is not None
            and not (sanity and self.skip_sanity_check)
            and (sanity or trainer.current_epoch % self.every_n_epochs == 0)
        )

    @override
    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if not self._monitoring_epoch or self.capture is None:
            return
        num_batches = trainer.num_val_batches[dataloader_idx] if trainer.num_val_batches else float("inf")
        if batch_idx in self.sampled_indices(num_batches, dataloader_idx):
            self.capture.metric = self._val_metric  # type: ignore[assignment]
            self._recording.enter_context(self.capture.recording(self.padding_mask(batch), self.document_ids(batch)))

    @override
    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._recording.close()

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._monitoring_epoch or self._val_metric is None:
            return
        self._monitoring_epoch = False
        summary = self._collect(trainer, self._val_metric)
        masses = self._collect(trainer, self.diagnostics.metric) if self.diagnostics.enabled else None
        if summary is None:
            return
        self.last_summary = summary
        extra = masses.to_dict("attn") if masses is not None else {}
        extra.update(self._collapse_flags(trainer, summary))
        self._log(trainer, summary, self.prefix, extra)
        if masses is not None:
            self._warn_leakage(masses)
        if self.save_summaries and trainer.is_global_zero:
            directory = os.path.join(trainer.log_dir or trainer.default_root_dir, "attn_entropy")
            os.makedirs(directory, exist_ok=True)
            save_summary(summary, os.path.join(directory, f"epoch{trainer.current_epoch}.pt"))

    def _collapse_flags(self, trainer: pl.Trainer, summary: EntropySummary) -> dict[str, float]:
        """Flag heads whose median crossed the collapse thresholds; warn once per head."""
        if self.collapse_threshold is None and self.collapse_drop is None:
            return {}
        medians = summary.quantile(0.5)
        if self._first_medians is None:
            self._first_medians = medians.clone()
        flagged = torch.zeros_like(medians, dtype=torch.bool)
        if self.collapse_threshold is not None:
            flagged |= medians < self.collapse_threshold
        if self.collapse_drop is not None and self._first_medians.shape == medians.shape:
            flagged |= medians < self._first_medians * (1.0 - self.collapse_drop)
        flags = {}
        for index, layer in enumerate(summary.layers):
            heads = [h for h in range(summary.num_heads[index]) if flagged[index, h]]
            flags[f"{self.prefix}/{layer}/collapsed_heads"] = float(len(heads))
            new = [h for h in heads if (layer, h) not in self._flagged]
            if new:
                self._flagged.update((layer, h) for h in new)
                rank_zero_warn(
                    f"attn_monitor: attention entropy collapse in {layer!r}, heads {new}: median normalised "
                    f"entropy {[round(float(medians[index, h]), 3) for h in new]} "
                    f"(first monitored epoch: {[round(float(self._first_medians[index, h]), 3) for h in new]}, "
                    f"threshold {self.collapse_threshold}, allowed drop {self.collapse_drop})."
                )
        if flagged.any() and self.stop_on_collapse:
            trainer.should_stop = True
        return flags

    def _warn_leakage(self, masses: MassSummary) -> None:
        leaky = [
            key.split("/", 1)[1]
            for index, key in enumerate(masses.layers)
            if key.startswith("leakage/") and masses.layer_mean[index] > LEAKAGE_TOLERANCE
        ]
        if leaky and not self._leaky_warned:
            self._leaky_warned = True
            rank_zero_warn(
                f"attn_monitor: queries attend across packed documents in layers {leaky}; the attention mask "
                "does not isolate the packed samples."
            )

    # -- training ----------------------------------------------------------
    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.train_every_n_steps is None or self.capture is None:
            return
        # One recording per optimizer step, also under gradient accumulation.
        step = trainer.global_step
        if step % self.train_every_n_steps == 0 and step != self._last_train_step:
            self._last_train_step = step
            self.capture.metric = self._train_metric  # type: ignore[assignment]
            self._recording.enter_context(self.capture.recording(self.padding_mask(batch), self.document_ids(batch)))
            self._training_step_recorded = True

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._training_step_recorded or self._train_metric is None:
            return
        self._training_step_recorded = False
        self._recording.close()
        summary = self._collect(trainer, self._train_metric)
        if summary is not None:
            self._log(trainer, summary, f"{self.prefix}_train")

    # -- shared --------------------------------------------------------------
    def _collect(self, trainer: pl.Trainer, metric: Any) -> Any:
        """Compute on every rank (a collective) and reset; None when nothing was recorded anywhere."""
        # Every rank must hold the same layer states before the sum; a rank whose
        # shard had no sampled batch registers them from rank zero's list.
        layers = trainer.strategy.broadcast([(name, metric.num_heads(name)) for name in metric.layers], src=0)
        for name, heads in layers:
            metric.register_layer(name, heads)
        if not layers:
            if self.capture is not None and self.capture.num_recordings > 0 and self.capture.num_calls == 0:
                rank_zero_warn(nothing_captured_message(self.capture.model))
            return None
        summary = metric.compute()
        metric.reset()
        return summary

    def _log(
        self, trainer: pl.Trainer, summary: EntropySummary, prefix: str, extra: dict[str, float] | None = None
    ) -> None:
        if not trainer.is_global_zero:
            return
        log_summary(
            trainer.loggers,
            summary,
            trainer.global_step,
            prefix=prefix,
            quantiles=self.quantiles,
            per_head=self.per_head,
            histogram_bins=self.histogram_bins,
            heatmap=self.heatmap,
            extra_scalars=extra,
        )

    # -- checkpointing -------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        first = None if self._first_medians is None else self._first_medians.tolist()
        return {"drawn": {int(k): list(v) for k, v in self._drawn.items()}, "seed": self.seed, "first_medians": first}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._drawn = {int(k): tuple(v) for k, v in state_dict.get("drawn", {}).items()}
        first = state_dict.get("first_medians")
        self._first_medians = None if first is None else torch.tensor(first, dtype=torch.float64)
