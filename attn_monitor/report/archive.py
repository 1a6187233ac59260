"""Saved summaries: one file per validation, loaded back with a clear error for anything else."""

from __future__ import annotations

import math
import os
import re
import tempfile
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from attn_monitor.metrics.entropy import EntropySummary
from attn_monitor.report.comparison import _COUNTS, _HISTOGRAMS, _OPTIONAL_V1, _STATS_V1, _describe

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "SummaryArchive", "load_summary", "save_summary"]


#: Value of the ``"format"`` key of a saved summary.
FORMAT_NAME = "attn_monitor.EntropySummary"


#: Version written by :func:`save_summary`; the only one :func:`load_summary` reads.
FORMAT_VERSION = 1


def save_summary(summary: EntropySummary, path: str | os.PathLike[str]) -> None:
    """Write ``summary`` to ``path`` in the versioned format of this module.

    The file is written next to its destination and renamed into place, so a
    crash never leaves a half-written summary under ``path``.

    Args:
        summary: what :meth:`AttentionEntropy.compute` returned.
        path: destination file (conventionally ``.pt``).

    Raises:
        TypeError: ``summary`` is not an :class:`EntropySummary`.
        OSError: the file cannot be written.

    Example:
        >>> import math, os, tempfile, torch
        >>> from attn_monitor import AttentionEntropy
        >>> metric = AttentionEntropy()
        >>> metric.update("layer.0", torch.full((1, 2, 3), math.log(4.0)), torch.tensor(4))  # uniform over 4 keys
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     path = os.path.join(folder, "summary.pt")
        ...     save_summary(metric.compute(), path)
        ...     load_summary(path).mean
        tensor([[1., 1.]], dtype=torch.float64)
    """
    if not isinstance(summary, EntropySummary):
        raise TypeError(f"Expected `summary` to be an EntropySummary, got {type(summary).__name__}.")
    payload = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "layers": [str(layer) for layer in summary.layers],
        "num_heads": [int(heads) for heads in summary.num_heads],
        "max_nats": float(summary.max_nats),
        "stats": {
            name: summary.stats(name).detach().to("cpu", torch.float64).contiguous()
            for name in _STATS_V1 + _OPTIONAL_V1
        },
    }
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    handle, temporary = tempfile.mkstemp(prefix=".attn_monitor-", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(handle, "wb") as file:
            torch.save(payload, file)
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise


class SummaryArchive:
    """One saved summary per monitored epoch in ``directory``: ``epoch{n}.pt``.

    With several validation dataloaders each gets its own file,
    ``epoch{n}_dataloader_idx_{i}.pt``.

    Example:
        >>> import math, os, tempfile, torch
        >>> from attn_monitor import AttentionEntropy
        >>> metric = AttentionEntropy()
        >>> metric.update("layer.0", torch.full((1, 1, 2), math.log(4.0)), torch.tensor(4))
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     archive = SummaryArchive(os.path.join(folder, "attn_entropy"))
        ...     path = archive.save(metric.compute(), epoch=3, dataloader_idx=1)
        ...     os.path.basename(path), load_summary(path).layers
        ('epoch3_dataloader_idx_1.pt', ['layer.0'])
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = os.fspath(directory)

    def save(self, summary: EntropySummary, epoch: int, dataloader_idx: int | None = None) -> str:
        """Save ``summary`` as the given epoch's (and dataloader's); returns the path."""
        os.makedirs(self.directory, exist_ok=True)
        suffix = "" if dataloader_idx is None else f"_dataloader_idx_{dataloader_idx}"
        path = os.path.join(self.directory, f"epoch{epoch}{suffix}.pt")
        save_summary(summary, path)
        return path


def load_summary(path: str | os.PathLike[str]) -> EntropySummary:
    """Read a summary written by :func:`save_summary`, checking everything in it.

    Loads with ``torch.load(..., weights_only=True)``: a file cannot run code.

    Args:
        path: a file written by :func:`save_summary`.

    Returns:
        The :class:`EntropySummary`, with every statistic as saved.

    Raises:
        FileNotFoundError: there is no file at ``path``.
        ValueError: the file is not a torch file, is truncated, is another
            format or an unsupported version, lacks a key, or holds tensors
            whose shapes disagree with its layers and heads. The message
            names the path and what is wrong.

    Example:
        >>> import os, tempfile
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     path = os.path.join(folder, "notes.pt")
        ...     with open(path, "w") as file:
        ...         _ = file.write("not a summary")
        ...     load_summary(path)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: Cannot read an attention entropy summary from '.../notes.pt': not a torch file...
    """
    name = os.fspath(path)
    with open(name, "rb") as file:  # FileNotFoundError, IsADirectoryError, PermissionError pass through
        try:
            with warnings.catch_warnings():
                # Garbage read as a pickle makes torch warn about protocols before it fails; the error says enough.
                warnings.simplefilter("ignore")
                payload = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as error:
            raise ValueError(
                f"Cannot read an attention entropy summary from {name!r}: {_load_failure(error)}."
            ) from None
    return _summary_from_payload(payload, name)


def _load_failure(error: Exception) -> str:
    """What went wrong in ``torch.load``, in one line (its own messages run to paragraphs)."""
    message = str(error)
    unsafe = re.search(r"GLOBAL ([\w.]+)", message)
    if unsafe:
        return (
            f"it holds a Python object ({unsafe.group(1)}) besides plain data and tensors, which is refused "
            "because loading it could run code"
        )
    detail = re.search(r"WeightsUnpickler error:\s*(\S[^\n]*)", message)
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    first_line = detail.group(1).strip() if detail else (lines[0] if lines else "no data")
    return f"not a torch file, or a truncated or damaged one ({type(error).__name__}: {first_line[:160]})"


def _summary_from_payload(payload: Any, name: str) -> EntropySummary:
    def fail(reason: str) -> ValueError:
        return ValueError(f"{name!r} is not a valid attention entropy summary: {reason}.")

    if not isinstance(payload, Mapping):
        raise fail(f"expected a dict with format {FORMAT_NAME!r}, found a {type(payload).__name__}")
    if payload.get("format") != FORMAT_NAME:
        raise fail(f"expected format {FORMAT_NAME!r}, found {payload.get('format')!r}")
    version = payload.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version != FORMAT_VERSION:
        hint = " (written by a newer attn_monitor? upgrade to read it)" if _is_newer(version) else ""
        raise fail(
            f"format version {version!r} is not supported{hint}; this attn_monitor reads version {FORMAT_VERSION}"
        )
    missing = [key for key in ("layers", "num_heads", "max_nats", "stats") if key not in payload]
    if missing:
        raise fail(f"missing key(s) {missing}")

    layers, num_heads, max_nats, stats = (payload[key] for key in ("layers", "num_heads", "max_nats", "stats"))
    if not isinstance(layers, list) or not all(isinstance(layer, str) and layer for layer in layers):
        raise fail(f"`layers` must be a list of non-empty names, found {layers!r}")
    if len(set(layers)) != len(layers):
        raise fail(f"`layers` holds a name twice: {layers}")
    if (
        not isinstance(num_heads, list)
        or len(num_heads) != len(layers)
        or not all(isinstance(heads, int) and not isinstance(heads, bool) and heads >= 1 for heads in num_heads)
    ):
        raise fail(f"`num_heads` must list one positive int per layer ({len(layers)}), found {num_heads!r}")
    if (
        not isinstance(max_nats, (int, float))
        or isinstance(max_nats, bool)
        or not math.isfinite(max_nats)
        or max_nats <= 0
    ):
        raise fail(f"`max_nats` must be a positive number, found {max_nats!r}")
    if not isinstance(stats, Mapping):
        raise fail(f"`stats` must be a dict of tensors, found a {type(stats).__name__}")
    missing = [kind for kind in _STATS_V1 if kind not in stats]
    if missing:
        raise fail(f"`stats` lacks {missing}")

    expected = (len(layers), max(num_heads, default=0))
    kinds = _STATS_V1 + tuple(kind for kind in _OPTIONAL_V1 if kind in stats)
    for kind in kinds:
        tensor = stats[kind]
        if not isinstance(tensor, Tensor) or tensor.dtype == torch.bool or tensor.is_complex():
            raise fail(f"stats[{kind!r}] must be a real-valued tensor, found {_describe(tensor)}")
        shape = tuple(tensor.shape)
        if kind in _HISTOGRAMS:
            good = len(shape) == 3 and shape[:2] == expected and shape[2] >= 1
            wanted = f"{(*expected, 'bins')} with bins >= 1"
        else:
            good = shape == expected
            wanted = str(expected)
        if not good:
            raise fail(
                f"stats[{kind!r}] has shape {shape}, expected {wanted} for {len(layers)} layers and "
                f"at most {expected[1]} heads"
            )
        if not bool(torch.isfinite(tensor).all()):
            raise fail(f"stats[{kind!r}] holds NaN or infinite values")
        if kind in _COUNTS and bool((tensor < 0).any()):
            raise fail(f"stats[{kind!r}] holds negative counts")
    return EntropySummary(layers, num_heads, {kind: stats[kind] for kind in kinds}, float(max_nats))


def _is_newer(version: object) -> bool:
    return isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION
