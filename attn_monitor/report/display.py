"""Layer names shortened for display: what sets the layers of one model apart.

Logged tags keep a layer's full qualified name (``model.transformer.h.0.attn``);
pictures, tables and text show the part that differs between the layers
(``0``), so a chart title fits on one line and a 32-layer label column stays
narrow.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["short_names"]


def short_names(names: Sequence[str]) -> list[str]:
    """``names`` with the dotted components every one of them shares at the start and the end dropped.

    Each shortened name keeps at least one component, so names stay non-empty
    and distinct names stay distinct (what is dropped is the same for all).
    The prefix goes first: of ``h.0.attn`` and ``h.0.attn.inner`` the second
    keeps ``attn.inner``. A single name, or names with nothing in common, are
    returned as they are.

    Args:
        names: layer names, e.g. ``EntropySummary.layers``.

    Returns:
        One display name per name, in order.

    Raises:
        ValueError: ``names`` holds a name twice (its display name would be ambiguous).

    Example:
        >>> short_names(["model.transformer.h.0.attn", "model.transformer.h.1.attn"])
        ['0', '1']
        >>> short_names(["encoder.layer.0.attention", "decoder.layer.0.attention", "decoder.layer.0.crossattention"])
        ['encoder.layer.0.attention', 'decoder.layer.0.attention', 'decoder.layer.0.crossattention']
        >>> short_names(["blocks.0.attn"])
        ['blocks.0.attn']
    """
    names = list(names)
    if len(set(names)) != len(names):
        repeated = sorted({name for name in names if names.count(name) > 1})
        raise ValueError(f"Expected distinct layer names in `names`, got {repeated} more than once.")
    if len(names) < 2:
        return names
    parts = [name.split(".") for name in names]
    room = min(len(p) for p in parts) - 1  # components that may go, leaving each name one
    prefix = _shared_run(parts, room, from_end=False)
    suffix = _shared_run(parts, room - prefix, from_end=True)
    return [".".join(p[prefix : len(p) - suffix]) for p in parts]


def _shared_run(parts: list[list[str]], limit: int, *, from_end: bool) -> int:
    """How many leading (or trailing) components, at most ``limit``, every name in ``parts`` shares."""
    count = 0
    while count < limit:
        index = -1 - count if from_end else count
        if len({p[index] for p in parts}) != 1:
            break
        count += 1
    return count
