"""Small pieces several modules share: layer-name patterns, argument checks, warn-once, descriptions.

Imports nothing beyond the standard library, so every module may use it.
"""

from __future__ import annotations

import fnmatch
import warnings
from collections.abc import Callable, Hashable, Iterable

__all__ = ["WarnOnce", "check_int", "describe", "matches"]


def matches(name: str, pattern: str) -> bool:
    """Whether a module's qualified ``name`` is ``pattern`` or matches it as an ``fnmatch`` glob.

    Example:
        >>> matches("blocks.3.attn", "blocks.*.attn"), matches("blocks.3.mlp", "blocks.*.attn")
        (True, False)
    """
    return name == pattern or fnmatch.fnmatchcase(name, pattern)


def check_int(name: str, value: object, minimum: int) -> int:
    """``value`` if it is an int (not a bool) >= ``minimum``; else TypeError or ValueError naming ``name``.

    Example:
        >>> check_int("batches", 0, 1)
        Traceback (most recent call last):
        ...
        ValueError: Expected `batches` to be an int >= 1, got 0.
    """
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"Expected `{name}` to be an int, got {type(value).__name__} {value!r}.")
    if value < minimum:
        raise ValueError(f"Expected `{name}` to be an int >= {minimum}, got {value!r}.")
    return value


class WarnOnce:
    """Warn once per key, however often the condition recurs (per batch, per epoch).

    The standard ``warnings`` filters deduplicate by message and source line
    only under the default filter, and not at all under ``"always"`` (pytest,
    notebooks); a key says what is "the same warning" whatever the message
    holds (counts, values).

    Args:
        warn: the function that warns, ``warn(message, stacklevel=...)``:
            :func:`warnings.warn` by default; the Lightning callback passes
            ``rank_zero_warn`` so that only rank zero speaks.

    Example:
        >>> import warnings
        >>> once = WarnOnce()
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     [once("layer.0", f"batch {i}: layer.0 is odd") for i in range(3)]
        [True, False, False]
        >>> [str(w.message) for w in caught]
        ['batch 0: layer.0 is odd']
    """

    def __init__(self, warn: Callable[..., object] = warnings.warn) -> None:
        self._warn = warn
        self._seen: set[Hashable] = set()

    def __call__(self, key: Hashable, message: str, *, stacklevel: int = 2) -> bool:
        """Warn with ``message`` unless ``key`` was seen; returns whether it warned."""
        if key in self._seen:
            return False
        self._seen.add(key)
        self._warn(message, stacklevel=stacklevel + 1)
        return True

    def unseen(self, keys: Iterable[Hashable]) -> list[Hashable]:
        """The ``keys`` not warned about yet, now counted as warned: for one warning about several findings."""
        new = [key for key in dict.fromkeys(keys) if key not in self._seen]
        self._seen.update(new)
        return new

    def __contains__(self, key: Hashable) -> bool:
        return key in self._seen


def describe(value: object) -> str:
    """A value as error messages name it: a tensor by shape and dtype, anything else by type."""
    if hasattr(value, "shape") and hasattr(value, "dtype"):  # a tensor, without importing torch here
        return f"tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    return type(value).__name__
