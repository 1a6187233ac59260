"""Hugging Face's attention interface: every registered kernel, read where it is called.

transformers routes every attention implementation but ``eager`` through
``ALL_ATTENTION_FUNCTIONS`` (``flash_attention_2/3/4``, ``flex_attention``,
``sdpa``, ``paged|eager`` and whatever users register with
``AttentionInterface.register``): attention modules look the function up by
``config._attn_implementation`` at call time and call
``fn(module, query, key, value, attention_mask, scaling=..., sliding_window=...,
softcap=..., ...)``. While a recording listens (:func:`listening`), every
entry of that mapping is wrapped: the wrapper calls the kernel unchanged and
then hands the call's q, k, mask and keyword arguments to the listeners; when
the last listener stops, the original entries come back (also on
exceptions, and whatever order nested listeners stop in). The model, its
configuration and its outputs are not changed. transformers is never
imported here: without it loaded, there is nothing to wrap.

:func:`read_interface_call` turns one call into q, k, scale, support and a
``score_mod`` (soft-capping). The mask a kernel receives depends on the mask
builder registered for its name (``AttentionMaskInterface``): a 4-dim bool
(True = visible) or additive float mask (``sdpa``, ``eager``), a
``BlockMask`` (``flex_attention``), a (batch, keys) padding mask or None
with packing in ``position_ids`` / ``cu_seq_lens_q`` (flash kernels). A name
with no mask builder gets None; the kernel is then taken to do what
transformers' own kernels do with None: causal order when the module is
causal (``module.is_causal``, default True), windowed by ``sliding_window``.
Paged calls (``paged|...``, continuous batching) read their keys from a
cache the call does not show: they are refused with a clear error (the
capture names the layer and skips it).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from attn_monitor.functional.entropy import logit_scale
from attn_monitor.functional.flex import ScoreMod, block_mask_support, softcap
from attn_monitor.functional.masks import Support

__all__ = ["InterfaceListener", "listening", "read_interface_call"]


class InterfaceListener(Protocol):
    """What a recording offers the wrappers (see :class:`~attn_monitor.capture.hooks.AttentionCapture`)."""

    def owns(self, module: nn.Module) -> bool:
        """Whether calls of ``module`` are this listener's."""

    def interface_enter(self) -> None:
        """A call of an owned module starts."""

    def interface_exit(self) -> int:
        """The call ended; returns how many attention calls the listener saw inside it."""

    def on_interface(
        self, module: nn.Module, implementation: str, query: Tensor, key: Tensor, mask: Any, kwargs: dict
    ) -> None:
        """Read one call no inner path saw."""


_LISTENERS: list[InterfaceListener] = []
#: implementation name -> (original function, its wrapper), while installed.
_INSTALLED: dict[str, tuple[Callable, Callable]] = {}


def _interface() -> Any:
    """transformers' ``ALL_ATTENTION_FUNCTIONS``, if transformers is loaded."""
    modeling_utils = sys.modules.get("transformers.modeling_utils")
    return getattr(modeling_utils, "ALL_ATTENTION_FUNCTIONS", None)


def _wrap(implementation: str, original: Callable) -> Callable:
    @functools.wraps(original)
    def wrapper(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, *args: Any, **kwargs: Any) -> Any:
        # Traced by torch.compile: pass through (the SDPA and flex paths still see what runs inside).
        owners = [] if torch.compiler.is_compiling() else [item for item in list(_LISTENERS) if item.owns(module)]
        if not owners:
            return original(module, query, key, value, *args, **kwargs)
        for listener in owners:
            listener.interface_enter()
        try:
            output = original(module, query, key, value, *args, **kwargs)
        finally:
            inner = [listener.interface_exit() for listener in owners]
        mask = args[0] if args else kwargs.get("attention_mask")
        for listener, count in zip(owners, inner, strict=True):
            if count == 0:  # an inner path (SDPA, flex) already read it otherwise
                listener.on_interface(module, implementation, query, key, mask, kwargs)
        return output

    return wrapper


#: (implementation, original) -> its wrapper: one wrapper per function, so that a compiled model sees the
#: same two states (wrapped or not) at every recording instead of a new function each time.
_WRAPPERS: dict[tuple[str, Callable], Callable] = {}


def _install(interface: Any) -> None:
    for implementation in list(interface.keys()):
        original = interface[implementation]
        wrapper = _WRAPPERS.get((implementation, original))
        if wrapper is None:
            wrapper = _WRAPPERS[implementation, original] = _wrap(implementation, original)
        interface[implementation] = wrapper  # the instance's own override, on top of the class-wide mapping
        _INSTALLED[implementation] = (original, wrapper)


def _restore(interface: Any) -> None:
    while _INSTALLED:
        implementation, (original, wrapper) = _INSTALLED.popitem()
        if interface.get(implementation) is not wrapper:
            continue  # replaced by someone else while installed: theirs stays
        del interface[implementation]  # uncovers the class-wide entry, if the original was one
        if interface.get(implementation) is not original:
            interface[implementation] = original


@contextmanager
def listening(listener: InterfaceListener) -> Iterator[None]:
    """Wrap the attention interface's entries while ``listener`` listens (nests in any order)."""
    interface = _interface()
    if interface is None:
        yield
        return
    if not _LISTENERS:
        _install(interface)
    _LISTENERS.append(listener)
    try:
        yield
    finally:
        _LISTENERS.remove(listener)
        if not _LISTENERS:
            _restore(interface)


def _documents_from_positions(position_ids: Tensor) -> Tensor:
    """(batch, seq) document ids of packed sequences: a new document wherever positions do not go up by one."""
    step = position_ids[:, 1:] - position_ids[:, :-1]
    return torch.nn.functional.pad((step != 1).long().cumsum(-1), (1, 0))


def _documents_from_lengths(cu_seq_lens: Tensor, length: int) -> Tensor:
    lengths = (cu_seq_lens[1:] - cu_seq_lens[:-1]).long()
    ids = torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths)
    return ids[None, :length]


def _causal_support(
    num_q: int,
    num_k: int,
    window: int | None,
    padding: Tensor | None,
    documents: Tensor | None,
    device: torch.device,
) -> Support:
    """Causal order as flash kernels align it: the last query sees the last key."""
    if num_q == num_k:
        return Support(num_q, num_k, padding_mask=padding, causal=True, window=window, document_ids=documents)
    rows = torch.arange(num_q, device=device)[:, None] + (num_k - num_q)
    cols = torch.arange(num_k, device=device)[None, :]
    visible = cols <= rows
    if window is not None:
        visible = visible & (cols > rows - window)
    return Support(num_q, num_k, padding_mask=padding, mask=visible[None, None])


def read_interface_call(
    module: nn.Module, query: Tensor, key: Tensor, mask: Any, kwargs: dict
) -> tuple[Tensor, Tensor, float, Support, ScoreMod | None]:
    """q, k, scale, support and ``score_mod`` of one call of a Hugging Face attention function.

    Args:
        module: the attention module (its ``is_causal`` decides causal order
            where the mask does not say).
        query: (batch, heads, seq_q, head_dim); key: (batch, kv_heads, seq_k, head_dim).
        mask: the ``attention_mask`` the function received (see the module docstring).
        kwargs: its keyword arguments (``scaling``, ``sliding_window``,
            ``softcap``, ``is_causal``, ``position_ids``, ``cu_seq_lens_q``, ``s_aux``).

    Raises:
        ValueError: a call whose distribution this reader cannot rebuild
            (attention sinks, a mask of another form).

    Example:
        >>> module = torch.nn.Module()
        >>> q = k = torch.zeros(1, 2, 3, 4)
        >>> _, _, scale, support, score_mod = read_interface_call(module, q, k, None, {"sliding_window": 2})
        >>> scale, support.num_valid().tolist(), score_mod
        (0.5, [[[1, 2, 2]]], None)
    """
    if not isinstance(query, Tensor) or not isinstance(key, Tensor) or query.dim() != 4 or key.dim() != 4:
        raise ValueError("Expected (batch, heads, seq, head_dim) query and key at the attention interface.")
    if kwargs.get("s_aux") is not None:
        raise ValueError("attention sinks (`s_aux`) add a logit outside the keys, which this reader does not model.")
    lengths_q, lengths_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if kwargs.get("cache") is not None or (
        isinstance(lengths_k, Tensor) and not (isinstance(lengths_q, Tensor) and torch.equal(lengths_q, lengths_k))
    ):
        raise ValueError(
            "a paged or cached call: the kernel reads keys from its cache that the call does not show, so their "
            "support cannot be rebuilt here (monitor full forward passes)."
        )
    q, k = query.detach(), key.detach()
    num_q, num_k = q.shape[2], k.shape[2]
    scaling = kwargs.get("scaling")
    scale = logit_scale(scaling, q.shape[-1])
    cap = kwargs.get("softcap")
    score_mod = softcap(float(cap)) if cap else None
    window = kwargs.get("sliding_window")
    window = int(window) if window else None
    causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", True) if causal is None else causal)
    if hasattr(mask, "as_tuple") and hasattr(mask, "mask_mod"):  # a flex BlockMask
        support = block_mask_support(mask.as_tuple(), q.shape[0], q.shape[1], num_q, num_k)
    elif isinstance(mask, Tensor) and mask.dim() == 4:
        # Mask builders fold windows and causal order into 4-dim masks.
        support = Support.from_sdpa(num_q, num_k, mask.detach()[..., -num_q:, :num_k], False)
    elif mask is None or (isinstance(mask, Tensor) and mask.dim() == 2):
        padding = None if mask is None else mask.detach()[:, -num_k:].bool()
        documents = None
        position_ids, lengths = kwargs.get("position_ids"), kwargs.get("cu_seq_lens_q")
        if mask is None and num_q == num_k and q.shape[0] == 1:
            if isinstance(lengths, Tensor) and lengths.dim() == 1:
                documents = _documents_from_lengths(lengths.detach(), num_k)
            elif isinstance(position_ids, Tensor) and position_ids.dim() == 2 and position_ids.shape[1] == num_k:
                documents = _documents_from_positions(position_ids.detach())
        if causal and num_q > 1:
            support = _causal_support(num_q, num_k, window, padding, documents, q.device)
        else:
            support = Support(num_q, num_k, padding_mask=padding, document_ids=documents)
    else:
        kind = f"shape {tuple(mask.shape)}" if isinstance(mask, Tensor) else type(mask).__name__
        raise ValueError(f"an attention_mask of {kind}, which is none of the forms transformers' mask builders give.")
    return q, k, scale, support, score_mod
