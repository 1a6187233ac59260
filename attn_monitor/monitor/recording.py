"""What the monitor records: one capture on the model, one set of metrics per purpose.

A :class:`Recorder` attaches one :class:`~attn_monitor.capture.hooks.AttentionCapture`
to the watched model and keeps a :class:`Stream` per purpose (each
validation dataloader, the training steps). A recording names its stream,
and the stream's consumers are handed to the capture when the recording
starts; nothing is reassigned afterwards. :class:`Statistics` says what
each stream measures beside entropy. No training framework here: the
monitor passes the module and the batch.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from attn_monitor.capture.calls import Adapter, Consumer
from attn_monitor.capture.consumers import EntropyUpdate, MassDiagnostics, StatisticsUpdate
from attn_monitor.capture.hooks import AttentionCapture, default_document_ids, default_padding_mask
from attn_monitor.capture.selfcheck import FastPathCheck, SelfCheck
from attn_monitor.metrics.bound import LogitBound, LogitBoundSummary
from attn_monitor.metrics.entropy import AttentionEntropy, EntropySummary
from attn_monitor.metrics.mass import AttentionMass, MassSummary
from attn_monitor.metrics.statistics import AttentionStatistics, StatisticsSummary, check_clip_threshold
from attn_monitor.shared.checks import WarnOnce, matches
from attn_monitor.shared.names import named_layers

__all__ = ["BatchMask", "Recorder", "Statistics", "Stream"]

#: ``function(batch) -> (batch, seq) tensor | None``: the padding mask or document ids of a batch.
BatchMask = Callable[[Any], "Tensor | None"]


@dataclass(frozen=True)
class Statistics:
    """What the monitor measures beside entropy; checked at construction.

    Args:
        include_single_key: count one-key queries (see :class:`AttentionEntropy`).
        sink_tokens: the attention-sink mass on the first ``sink_tokens`` real
            tokens of each sequence (document), logged as ``attn_sink_mass/...``.
        eviction: (sink_tokens, window) KV-cache policies whose kept mass is
            logged as ``attn_coverage_s{s}_w{w}/...``.
        leakage: cross-document leakage (``attn_leakage/...``), with one
            warning naming the layers when a packed batch's documents are not
            isolated by the model's mask. Needs document ids.
        max_logit: each layer's largest attention logit over heads and sampled
            queries, ``attn_max_logit/{layer}/max`` (and per head); not for
            layers that return probabilities, which are named in one warning.
        distance: the mean attention distance ``E|i - j|`` in positions,
            ``attn_distance/{layer}/mean`` (and per head), self-attention layers.
        max_logit_bound: a bracket ``[lse - H, lse]`` on each head's max logit
            from the entropy pass itself (no extra pass), on every recorded
            batch, training steps included: ``attn_max_logit_bound/{layer}/lower|upper``
            (``attn_max_logit_bound_train/...`` for training steps; see
            :mod:`attn_monitor.metrics.bound`). Layers that return probabilities get none.
        self_check: when to recompute one sampled query block per layer in
            float64 and compare with the fast q/k path (a layer that disagrees
            is named once and takes the exact path); by default the first
            recorded batch of a run. None: off. See :mod:`attn_monitor.capture.selfcheck`.
        clip_threshold: a QK-Clip dry run at this tau (the recipe's 100): per
            layer the heads a clip would rescale, ``attn_qk_clip/{layer}/clipped_heads``,
            and per head the factor ``min(1, tau / max_logit)``,
            ``attn_qk_clip_heads/{layer}/head_{h}/factor``. Needs ``max_logit``.

    The mass diagnostics, max logit and distance are measured on validation
    batches only (see :class:`MassDiagnostics` and :class:`StatisticsUpdate`);
    the max-logit bound on every recorded batch.

    Raises:
        TypeError, ValueError: a bad option, named.

    Example:
        >>> Statistics(sink_tokens=4).masses, Statistics(max_logit=True).heads
        (True, True)
        >>> Statistics(distance="yes")
        Traceback (most recent call last):
        ...
        TypeError: Expected `distance` to be a bool, got str 'yes'.
    """

    include_single_key: bool = False
    sink_tokens: int | None = None
    eviction: Sequence[tuple[int, int]] = ()
    leakage: bool = False
    max_logit: bool = False
    distance: bool = False
    max_logit_bound: bool = False
    self_check: SelfCheck | None = field(default_factory=SelfCheck)
    clip_threshold: float | None = None

    def __post_init__(self) -> None:
        for name in ("max_logit", "distance", "max_logit_bound"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"Expected `{name}` to be a bool, got {type(value).__name__} {value!r}.")
        if self.self_check is not None and not isinstance(self.self_check, SelfCheck):
            raise TypeError(f"Expected `self_check` to be a SelfCheck or None, got {type(self.self_check).__name__}.")
        if self.clip_threshold is not None:
            check_clip_threshold(self.clip_threshold, "clip_threshold")
            if not self.max_logit:
                raise ValueError(
                    f"`clip_threshold={self.clip_threshold!r}` needs `Statistics(max_logit=True)`: the QK-Clip dry "
                    "run reads each head's max logit."
                )
        checked = MassDiagnostics(sink_tokens=self.sink_tokens, eviction=self.eviction, leakage=self.leakage)
        object.__setattr__(self, "eviction", tuple(checked.eviction))
        object.__setattr__(self, "leakage", checked.leakage)
        object.__setattr__(self, "include_single_key", bool(self.include_single_key))

    @property
    def masses(self) -> bool:
        """Whether a mass diagnostic is on."""
        return self.sink_tokens is not None or bool(self.eviction) or self.leakage

    @property
    def heads(self) -> bool:
        """Whether a head statistic (max logit, distance) is on."""
        return self.max_logit or self.distance


@dataclass
class Stream:
    """The metrics one purpose fills: entropy (and its max-logit bound), mass diagnostics and head statistics."""

    entropy: AttentionEntropy
    diagnostics: MassDiagnostics | None = None
    statistics: StatisticsUpdate | None = None
    bound: LogitBound | None = None
    check: FastPathCheck | None = None
    update: EntropyUpdate = field(init=False)

    def __post_init__(self) -> None:
        self.update = EntropyUpdate(self.entropy, bound=self.bound, check=self.check)

    @property
    def consumers(self) -> list[Consumer]:
        extra = [consumer for consumer in (self.diagnostics, self.statistics) if consumer is not None]
        return [self.update, *extra]


class Recorder:
    """Capture attention of a model on chosen batches into per-purpose metrics.

    Args:
        statistics: what each stream measures beside entropy (mass
            diagnostics and head statistics go to the streams that ask for them).
        padding_mask: ``padding_mask(batch) -> (batch, seq)`` real tokens;
            default: a dict batch's ``attention_mask``.
        document_ids: ``document_ids(batch) -> (batch, seq)``; default: a dict
            batch's ``document_ids``.
        module: ``module(root) -> nn.Module`` to watch (default: the root).
        layers: layer name patterns; each must match a module at :meth:`attach`.
        adapters: module name pattern -> adapter (see :class:`AttentionCapture`).
        num_bins: histogram bins of every entropy metric.

    Raises:
        TypeError, ValueError: a bad argument, named.

    Example:
        >>> import torch
        >>> layer = torch.nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, batch_first=True)
        >>> recorder = Recorder()
        >>> recorder.attach(layer)
        >>> with torch.no_grad(), recorder.recording("validation", torch.randn(2, 5, 8)):
        ...     _ = layer(torch.randn(2, 5, 8))
        >>> summary, masses = recorder.collect("validation")
        >>> summary.layers, int(summary.count.sum()), masses
        (['self_attn'], 20, None)
        >>> recorder.release()
    """

    def __init__(
        self,
        statistics: Statistics | None = None,
        *,
        padding_mask: BatchMask | None = None,
        document_ids: BatchMask | None = None,
        module: Callable[[Any], nn.Module] | None = None,
        layers: Sequence[str] | None = None,
        adapters: Mapping[str, Adapter] | None = None,
        num_bins: int = 1000,
    ) -> None:
        self.statistics = Statistics() if statistics is None else statistics
        if not isinstance(self.statistics, Statistics):
            raise TypeError(f"Expected `statistics` to be a Statistics, got {type(self.statistics).__name__}.")
        for name, value in (("padding_mask", padding_mask), ("document_ids", document_ids), ("module", module)):
            if value is not None and not callable(value):
                raise TypeError(f"Expected `{name}` to be callable, got {type(value).__name__}.")
        if isinstance(layers, str):
            raise TypeError(f"Expected `layers` to be a sequence of patterns, got the string {layers!r}.")
        self.padding_mask = padding_mask or default_padding_mask
        self.document_ids = document_ids or default_document_ids
        self.module = module
        self.layers = None if layers is None else list(layers)
        self.adapters = dict(adapters or {})
        self.num_bins = num_bins
        # One set of layer warnings for every stream: a layer is named once, not once per dataloader.
        self._statistics_warnings = WarnOnce()
        #: The self-check of the fast path, shared by every stream (None: off).
        self.check = None if self.statistics.self_check is None else FastPathCheck(self.statistics.self_check)
        self.capture: AttentionCapture | None = None
        self.streams: dict[Hashable, Stream] = {}
        self._device = torch.device("cpu")

    @property
    def attached(self) -> bool:
        return self.capture is not None

    def attach(self, root: nn.Module, device: torch.device | str = "cpu") -> None:
        """Find the attention of ``module(root)`` and put the capture's hooks on it (once).

        Raises:
            TypeError: ``module(root)`` is not an ``nn.Module``.
            ValueError: a layer pattern matches no module.
        """
        if self.capture is not None:
            return
        model = self.module(root) if self.module is not None else root
        if not isinstance(model, nn.Module):
            raise TypeError(f"Expected `module(pl_module)` to return an nn.Module, got {type(model).__name__}.")
        if self.layers is not None:
            names = [name for name, _ in named_layers(model) if name]
            unmatched = [p for p in self.layers if not any(matches(name, p) for name in names)]
            if unmatched:
                raise ValueError(f"Layer patterns {unmatched} match no module of {type(model).__name__}.")
        self._device = torch.device(device)
        # Inside a training run a call the capture cannot read is skipped and named, never raised.
        self.capture = AttentionCapture(model, layers=self.layers, adapters=self.adapters, errors="warn").attach()

    def reset(self) -> None:
        """Drop every stream and what it holds (partial counts of a run that failed): the next starts from zero."""
        self.streams.clear()
        if self.check is not None:
            self.check.reset()

    def release(self) -> None:
        """Remove the capture's hooks; the streams stay."""
        if self.capture is not None:
            self.capture.detach()
            self.capture = None

    def stream(self, key: Hashable, *, diagnostics: bool = True) -> Stream:
        """The stream of ``key``, made on first use (with the statistics asked for, if ``diagnostics``)."""
        if key not in self.streams:
            asked = self.statistics
            entropy = AttentionEntropy(num_bins=self.num_bins, include_single_key=asked.include_single_key)
            masses = None
            if diagnostics and asked.masses:
                masses = MassDiagnostics(
                    sink_tokens=asked.sink_tokens,
                    eviction=asked.eviction,
                    leakage=asked.leakage,
                    metric=AttentionMass().to(self._device),
                )
            statistics = None
            if diagnostics and asked.heads:
                statistics = StatisticsUpdate(
                    AttentionStatistics().to(self._device),
                    max_logit=asked.max_logit,
                    distance=asked.distance,
                    warn_once=self._statistics_warnings,
                )
            bound = LogitBound().to(self._device) if asked.max_logit_bound else None
            self.streams[key] = Stream(entropy.to(self._device), masses, statistics, bound, self.check)
        return self.streams[key]

    @contextmanager
    def recording(self, key: Hashable, batch: Any, *, diagnostics: bool = True) -> Iterator[None]:
        """Record the attention calls inside the block into the stream ``key``.

        Raises:
            RuntimeError: not attached.
        """
        if self.capture is None:
            raise RuntimeError("Attach the recorder to a model before recording.")
        stream = self.stream(key, diagnostics=diagnostics)
        if self.check is not None:
            self.check.start_batch()
        with self.capture.recording(self.padding_mask(batch), self.document_ids(batch), consumers=stream.consumers):
            yield

    @property
    def saw_nothing(self) -> bool:
        """Batches were recorded but no attention call was seen in them."""
        return self.capture is not None and self.capture.num_recordings > 0 and self.capture.num_calls == 0

    def collect(self, key: Hashable) -> tuple[EntropySummary | None, MassSummary | None]:
        """Compute and reset the stream ``key`` (a collective under DDP: every rank calls it).

        The metrics merge their layers by name across ranks, so a rank whose
        shard had no sampled batch takes part all the same.

        Returns:
            The entropy summary (None when no rank recorded any layer) and the
            mass summary (None when diagnostics are off or nothing was recorded).
        """
        stream = self.stream(key)
        summary = _compute(stream.entropy)
        masses = None if stream.diagnostics is None else _compute(stream.diagnostics.metric)
        return summary, masses

    def collect_statistics(self, key: Hashable) -> StatisticsSummary | None:
        """Compute and reset the head statistics of the stream ``key`` (a collective under DDP).

        Returns:
            None when max logit and distance are off or nothing was recorded.
        """
        statistics = self.stream(key).statistics
        return None if statistics is None else _compute(statistics.metric)

    def collect_bound(self, key: Hashable) -> LogitBoundSummary | None:
        """Compute and reset the max-logit bound of the stream ``key`` (a collective under DDP).

        Returns:
            None when the bound is off or nothing was recorded.
        """
        bound = self.stream(key).bound
        return None if bound is None else _compute(bound)


def _compute(metric: AttentionEntropy | AttentionMass | AttentionStatistics | LogitBound) -> Any:
    """``metric.compute()`` on every rank, then reset; None when no rank holds a layer."""
    with warnings.catch_warnings():
        # A rank (or a run) that recorded nothing still takes part in the sync; that is expected here.
        warnings.filterwarnings("ignore", message="The ``compute`` method of metric", category=UserWarning)
        summary = metric.compute()
    metric.reset()
    return summary if summary.layers else None
