"""The support of each query: which keys the model's mask lets it see.

A :class:`Support` describes one attention call's mask from the pieces a
batch and a model actually use (key padding, causal order, packed documents,
a sliding window, an explicit boolean or additive mask) and answers the two
questions every entropy statistic needs without building an N x N tensor for
the structured pieces:

* ``num_valid()``: how many keys each query may attend to (closed forms,
  docs/design.md §6), and
* ``is_sample()``: whether the query counts at all (not a padding query, and
  at least one visible key).

It also hands out the mask in the form each entropy path needs: boolean
blocks for the exact chunked path, an additive mask for fused kernels.
"""

from __future__ import annotations

import copy
import math
import weakref
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import Tensor

__all__ = ["Support", "broadcasts_to", "leading_keys", "log_count"]


def broadcasts_to(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """Whether a tensor of ``shape`` broadcasts to exactly ``target``.

    Plain Python on purpose: ``torch.broadcast_shapes`` pulls in sympy on its
    first call, seconds of start-up for a shape check.
    """
    if len(shape) > len(target):
        return False
    return all(size in (1, full) for size, full in zip(reversed(shape), reversed(target), strict=False))


def _check_padding(name: str, value: Tensor | None, length: int) -> Tensor | None:
    if value is None:
        return None
    if not isinstance(value, Tensor):
        raise TypeError(f"Expected `{name}` to be a torch.Tensor, got {type(value).__name__}.")
    if value.dtype != torch.bool and value.dtype.is_floating_point:
        raise TypeError(f"Expected `{name}` to be a bool or integer tensor (1 = real token), got dtype {value.dtype}.")
    if value.dim() != 2 or value.shape[1] != length:
        raise ValueError(f"Expected `{name}` with shape (batch, {length}), got shape {tuple(value.shape)}.")
    return value.bool()


def _compact(mask: Tensor) -> Tensor:
    """``mask`` with every broadcast (stride-0) dim cut back to size 1: a view, nothing copied."""
    for dim in range(mask.dim()):
        if mask.shape[dim] > 1 and mask.stride(dim) == 0:
            mask = mask.narrow(dim, 0, 1)
    return mask


def _window(part: Tensor, dim: int, start: int, stop: int) -> Tensor:
    """``part[start:stop]`` along ``dim``, leaving a broadcast (size-1) dim as it is."""
    return part if part.shape[dim] == 1 else part.narrow(dim, start, stop - start)


def _mask_to_bool_and_bias(mask: Tensor) -> tuple[Tensor, Tensor | None]:
    """Split an SDPA-style mask into visibility and any additive bias.

    Boolean masks are visibility (True = visible). Float masks are additive:
    ``-inf`` (or the dtype's most negative value, as Hugging Face writes) hides
    a key; any other value keeps it visible, and non-zero finite values are a
    bias that changes the attention distribution.
    """
    if mask.dtype == torch.bool:
        return mask, None
    if not mask.dtype.is_floating_point:
        raise TypeError(f"Expected `mask` to be bool or floating point, got dtype {mask.dtype}.")
    if torch.isnan(mask).any():
        raise ValueError("Expected `mask` without NaN values; an additive mask uses -inf to hide a key.")
    visible = mask > torch.finfo(mask.dtype).min / 2
    bias = torch.where(visible, mask, torch.zeros((), dtype=mask.dtype, device=mask.device))
    if not bias.any():
        return visible, None
    return visible, bias


#: (queries, keys, causal, window): the whole of a support without any mask tensor.
_ShapeKey = tuple[int, int, bool, int | None]
#: Counts of such supports (causal order, a window), by shape.
_STATIC_COUNTS: dict[_ShapeKey, Tensor] = {}
#: ln of those counts per (dtype, device), for the same shapes.
_STATIC_LOG_COUNTS: dict[_ShapeKey, dict[tuple[torch.dtype, torch.device], Tensor]] = {}

_Cached = TypeVar("_Cached")


def _static(cache: dict[_ShapeKey, _Cached], key: _ShapeKey, make: Callable[[], _Cached]) -> _Cached:
    """``cache[key]``, made on first use; the cache is emptied once it holds 64 shapes."""
    if key not in cache:
        if len(cache) >= 64:
            cache.clear()
        cache[key] = make()
    return cache[key]


def log_count(num_valid: Tensor, dtype: torch.dtype) -> Tensor:
    """``ln(num_valid)`` in ``dtype``, NaN where a query sees no key: the bound of its entropy in nats."""
    count = num_valid.to(dtype)
    return count.log().masked_fill(count == 0, math.nan)


class Support:
    """The set of keys each query of one attention call may attend to.

    All pieces combine by intersection. Shapes: ``batch`` is B, queries Nq,
    keys Nk. Masks follow the SDPA convention (True = the key is visible).

    Args:
        num_queries: Nq, the number of query positions.
        num_keys: Nk, the number of key positions. Defaults to ``num_queries``.
        padding_mask: (B, Nk) bool or 0/1 integers, True for real tokens (the
            Hugging Face ``attention_mask``). Padding keys are never visible.
            When Nq == Nk it also marks padding queries, which are not samples.
        query_mask: (B, Nq) bool; overrides which queries are real tokens.
        causal: query i sees keys j <= i (top-left aligned, as SDPA's
            ``is_causal``).
        window: with ``causal``, query i sees only keys j > i - window (the
            ``window`` most recent keys, itself included).
        document_ids: (B, N) integers for packed sequences (Nq == Nk): a query
            sees only keys of its own document. Each document must be one
            contiguous run of positions.
        mask: explicit mask broadcastable to (B, H, Nq, Nk): bool (True =
            visible) or additive float (-inf hides a key; other non-zero
            values are a bias the exact path adds to the logits).

    Raises:
        TypeError: a mask of the wrong type or dtype.
        ValueError: shapes that disagree, a window without ``causal`` or not
            positive, documents that are not contiguous.

    Example:
        >>> import torch
        >>> support = Support(4, padding_mask=torch.tensor([[1, 1, 1, 0]]), causal=True)
        >>> support.num_valid()
        tensor([[[1, 2, 3, 3]]])
        >>> support.is_sample()
        tensor([[[ True,  True,  True, False]]])
    """

    def __init__(
        self,
        num_queries: int,
        num_keys: int | None = None,
        *,
        padding_mask: Tensor | None = None,
        query_mask: Tensor | None = None,
        causal: bool = False,
        window: int | None = None,
        document_ids: Tensor | None = None,
        mask: Tensor | None = None,
    ) -> None:
        num_keys = num_queries if num_keys is None else num_keys
        for name, value in (("num_queries", num_queries), ("num_keys", num_keys)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Expected `{name}` to be a positive int, got {value!r}.")
        if window is not None:
            if not isinstance(window, int) or isinstance(window, bool) or window < 1:
                raise ValueError(f"Expected `window` to be a positive int or None, got {window!r}.")
            if not causal:
                raise ValueError("`window` is a causal sliding window; pass `causal=True` with it.")
        self.num_queries = num_queries
        self.num_keys = num_keys
        self.causal = bool(causal)
        self.window = window
        self.padding_mask = _check_padding("padding_mask", padding_mask, num_keys)
        self.query_mask = _check_padding("query_mask", query_mask, num_queries)
        if self.query_mask is None and self.padding_mask is not None and num_queries == num_keys:
            self.query_mask = self.padding_mask
        self.document_ids = self._check_documents(document_ids)
        self.mask: Tensor | None = None
        self.bias: Tensor | None = None
        if mask is not None:
            if not isinstance(mask, Tensor):
                raise TypeError(f"Expected `mask` to be a torch.Tensor, got {type(mask).__name__}.")
            if mask.dim() < 2 or not broadcasts_to(tuple(mask.shape[-2:]), (num_queries, num_keys)):
                raise ValueError(
                    f"Expected `mask` broadcastable to (batch, heads, {num_queries}, {num_keys}), "
                    f"got shape {tuple(mask.shape)}."
                )
            if mask.dim() > 4:
                raise ValueError(f"Expected `mask` with at most 4 dims, got shape {tuple(mask.shape)}.")
            while mask.dim() < 4:
                mask = mask.unsqueeze(0)
            # Kept in its broadcast shape: a (B, 1, 1, Nk) mask never grows to (B, 1, Nq, Nk).
            self.mask, self.bias = _mask_to_bool_and_bias(_compact(mask))
            if self.bias is None and self.mask.shape[1] == 1 and self.mask.shape[2] == 1:
                # Query- and head-independent: a key mask, with closed-form counts and no N x N tensor.
                keys = self.mask[:, 0, 0, :].expand(self.mask.shape[0], num_keys)
                self.padding_mask = keys if self.padding_mask is None else self.padding_mask & keys
                self.mask = None
        self.batch_size = self._check_batch_sizes()
        self._num_valid: Tensor | None = None
        self._log_counts: dict[tuple[torch.dtype, torch.device], Tensor] = {}
        self._bounds: tuple[Tensor, Tensor] | None = None

    @classmethod
    def from_sdpa(cls, num_queries: int, num_keys: int, attn_mask: Tensor | None, is_causal: bool) -> Support:
        """The support of an SDPA call, in structured form where the mask allows.

        Models pass causal order, key padding, sliding windows and packed
        documents as one dense (B, 1, N, N) mask, bool or additive (0 and
        ``-inf`` or the dtype's minimum). Recognised, it becomes ``causal``,
        ``window``, ``document_ids`` and a key mask: closed-form counts, and
        fused kernels that skip hidden blocks and never see an N x N tensor.
        Masks that broadcast over queries are key masks already. Which
        queries are samples is not taken from the mask. Any other mask is
        kept as it is.

        Example:
            >>> padding = torch.tensor([[True, True, False]])
            >>> dense = torch.ones(3, 3, dtype=torch.bool).tril() & padding[:, None, None, :]
            >>> Support.from_sdpa(3, 3, dense, False)
            Support(num_queries=3, num_keys=3, padding_mask, causal)
        """
        if attn_mask is not None and not is_causal and num_queries == num_keys:
            support = _structured_once(attn_mask, num_queries)
            if support is not None:
                return support
        return cls(num_queries, num_keys, causal=is_causal, mask=attn_mask)

    @classmethod
    def _from_structure(cls, length: int, structure: _Structure) -> Support:
        keys, causal, window, documents = structure
        support = cls(length, length, causal=causal, window=window)
        if documents is not None:  # contiguous runs by construction: no need to check them again
            support.document_ids = documents
            support.batch_size = support._check_batch_sizes()
        return support if keys is None else support._restricted(keys)

    def _check_documents(self, document_ids: Tensor | None) -> Tensor | None:
        if document_ids is None:
            return None
        if not isinstance(document_ids, Tensor):
            raise TypeError(f"Expected `document_ids` to be a torch.Tensor, got {type(document_ids).__name__}.")
        if document_ids.dtype.is_floating_point or document_ids.dtype == torch.bool:
            raise TypeError(f"Expected `document_ids` with an integer dtype, got {document_ids.dtype}.")
        if self.num_queries != self.num_keys:
            raise ValueError(
                f"`document_ids` needs self-attention (num_queries == num_keys), "
                f"got {self.num_queries} queries and {self.num_keys} keys."
            )
        if document_ids.dim() != 2 or document_ids.shape[1] != self.num_keys:
            raise ValueError(
                f"Expected `document_ids` with shape (batch, {self.num_keys}), got shape {tuple(document_ids.shape)}."
            )
        runs = (document_ids[:, 1:] != document_ids[:, :-1]).sum(-1) + 1
        ordered = document_ids.sort(dim=-1).values
        distinct = (ordered[:, 1:] != ordered[:, :-1]).sum(-1) + 1
        if (runs != distinct).any():
            row = int((runs != distinct).nonzero()[0, 0])
            raise ValueError(
                f"Expected each document in `document_ids` to be one contiguous run of positions; "
                f"row {row} has {int(distinct[row])} ids in {int(runs[row])} runs."
            )
        return document_ids

    def _check_batch_sizes(self) -> int:
        sizes = {
            name: int(value.shape[0])
            for name, value in (
                ("padding_mask", self.padding_mask),
                ("query_mask", self.query_mask),
                ("document_ids", self.document_ids),
                ("mask", self.mask),
            )
            if value is not None and int(value.shape[0]) != 1
        }
        if len(set(sizes.values())) > 1:
            raise ValueError(f"Expected one batch size across the masks, got {sizes}.")
        return next(iter(sizes.values()), 1)

    def block(self, q_start: int, q_stop: int, k_start: int, k_stop: int) -> Tensor | None:
        """Visibility of keys ``[k_start, k_stop)`` to queries ``[q_start, q_stop)``.

        Returns:
            Bool tensor broadcastable to (B, H, q_stop - q_start, k_stop - k_start),
            or None when every key is visible.
        """
        visible: Tensor | None = None

        def meet(part: Tensor) -> None:
            nonlocal visible
            visible = part if visible is None else visible & part

        device = self._device()
        if self.causal:
            rows = torch.arange(q_start, q_stop, device=device)[:, None]
            cols = torch.arange(k_start, k_stop, device=device)[None, :]
            meet(cols <= rows)
            if self.window is not None:
                meet(cols > rows - self.window)
        if self.padding_mask is not None:
            meet(self.padding_mask[:, None, None, k_start:k_stop])
        if self.document_ids is not None:
            docs = self.document_ids
            meet(docs[:, None, q_start:q_stop, None] == docs[:, None, None, k_start:k_stop])
        if self.mask is not None:
            meet(_window(_window(self.mask, 2, q_start, q_stop), 3, k_start, k_stop))
        return visible

    def dense(self) -> Tensor:
        """The whole support as a bool tensor broadcastable to (B, H, Nq, Nk)."""
        visible = self.block(0, self.num_queries, 0, self.num_keys)
        if visible is None:
            return torch.ones(1, 1, self.num_queries, self.num_keys, dtype=torch.bool, device=self._device())
        while visible.dim() < 4:
            visible = visible.unsqueeze(0)
        return visible

    def key_range(self, q_start: int, q_stop: int) -> tuple[int, int]:
        """A range of keys outside which queries ``[q_start, q_stop)`` see nothing.

        Lets the chunked path skip key blocks the structure hides entirely.
        """
        return self.key_blocks(q_stop - q_start, q_start, q_stop)[0][2:]

    def key_blocks(self, block: int, q_start: int = 0, q_stop: int | None = None) -> list[tuple[int, int, int, int]]:
        """``(q_start, q_stop, k_start, k_stop)`` per block of ``block`` queries: the keys each block may see.

        Causal order, a window and packed documents bound the range; keys
        outside it are hidden from every query of the block, so a kernel can
        skip them. One device round trip in all (documents only).
        """
        q_stop = self.num_queries if q_stop is None else q_stop
        starts = list(range(q_start, q_stop, block))
        stops = [min(q_stop, start + block) for start in starts]
        k_starts, k_stops = [0] * len(starts), [self.num_keys] * len(starts)
        if self.document_ids is not None:
            doc_start, doc_stop = self._document_bounds()
            bounds = torch.stack(
                [
                    torch.stack([doc_start[:, a:b].amin(), doc_stop[:, a:b].amax()])
                    for a, b in zip(starts, stops, strict=True)
                ]
            ).tolist()
            k_starts, k_stops = [int(low) for low, _ in bounds], [int(high) for _, high in bounds]
        if self.causal:
            k_stops = [min(high, stop) for high, stop in zip(k_stops, stops, strict=True)]
            if self.window is not None:
                k_starts = [max(low, start - self.window + 1) for low, start in zip(k_starts, starts, strict=True)]
        return [
            (start, stop, low, max(low, high))
            for start, stop, low, high in zip(starts, stops, k_starts, k_stops, strict=True)
        ]

    def bias_block(self, q_start: int, q_stop: int, k_start: int, k_stop: int) -> Tensor | None:
        """The additive bias of an explicit float mask on one block (broadcastable), or None."""
        if self.bias is None:
            return None
        return _window(_window(self.bias, 2, q_start, q_stop), 3, k_start, k_stop)

    @property
    def may_hide_every_key(self) -> bool:
        """Whether some query might see no key at all (never with causal order or no mask alone)."""
        return self.padding_mask is not None or self.document_ids is not None or self.mask is not None

    def num_valid(self) -> Tensor:
        """Number of visible keys per query (computed once, then reused).

        Returns:
            Long tensor broadcastable to (B, H, Nq); the head dim is 1 unless an
            explicit per-head mask is involved.
        """
        if self._num_valid is None:
            if self.may_hide_every_key:
                self._num_valid = self._count_valid()
            else:  # the same for every call of this shape: computed once per process
                self._num_valid = _static(_STATIC_COUNTS, self._shape_key(), self._count_valid)
        return self._num_valid

    def log_num_valid(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        """``ln(num_valid())`` in ``dtype`` on ``device``, NaN where a query sees no key (computed once).

        The upper bound of every query's entropy in nats.
        """
        logs = self._log_counts
        if not self.may_hide_every_key:
            logs = _static(_STATIC_LOG_COUNTS, self._shape_key(), dict)
        key = (dtype, device)
        if key not in logs:
            logs[key] = log_count(self.num_valid().to(device), dtype)
        return logs[key]

    def _shape_key(self) -> _ShapeKey:
        return (self.num_queries, self.num_keys, self.causal, self.window)

    def _count_valid(self) -> Tensor:
        if self.mask is not None:
            visible = self.dense()
            return visible.sum(-1, dtype=torch.long)
        device = self._device()
        num_q, num_k = self.num_queries, self.num_keys
        if self.window is None and self.document_ids is None and self.padding_mask is not None:
            if not self.causal:  # a key mask: the same count for every query
                return self.padding_mask.sum(-1, keepdim=True)[:, None, :].expand(-1, 1, num_q)
            # query i sees the real keys among [0, min(i + 1, Nk)).
            real = self.padding_mask.cumsum(-1)
            if num_q > num_k:
                real = torch.cat([real, real[:, -1:].expand(-1, num_q - num_k)], dim=-1)
            return real[:, None, :num_q]
        rows = torch.arange(num_q, device=device)
        upper = torch.clamp(rows + 1, max=num_k) if self.causal else torch.full_like(rows, num_k)
        lower = torch.clamp(rows - self.window + 1, min=0) if self.window is not None else torch.zeros_like(rows)
        upper, lower = upper.expand(self.batch_size, num_q), lower.expand(self.batch_size, num_q)
        if self.document_ids is not None:
            doc_start, doc_stop = self._document_bounds()
            lower, upper = torch.maximum(lower, doc_start), torch.minimum(upper, doc_stop)
        if self.padding_mask is None:
            count = upper - lower
        else:
            # prefix[:, j] = number of real keys among positions [0, j).
            prefix = torch.nn.functional.pad(self.padding_mask.long().cumsum(-1), (1, 0))
            prefix = prefix.expand(self.batch_size, num_k + 1)
            count = prefix.gather(1, upper) - prefix.gather(1, torch.minimum(lower, upper))
        return count.clamp(min=0)[:, None, :]

    def _document_bounds(self) -> tuple[Tensor, Tensor]:
        """Start and stop of each position's document (computed once, then reused)."""
        assert self.document_ids is not None  # only called with documents
        if self._bounds is None:
            self._bounds = _run_bounds(self.document_ids)
        return self._bounds

    def is_sample(self) -> Tensor:
        """Whether each query counts: a real token with at least one visible key.

        Returns:
            Bool tensor broadcastable to (B, H, Nq).
        """
        sample = self.num_valid() > 0
        if self.query_mask is not None:
            sample = sample & self.query_mask[:, None, :]
        return sample

    def additive_mask(self, dtype: torch.dtype) -> tuple[Tensor | None, bool]:
        """The support as fused SDPA kernels take it: ``(attn_mask, is_causal)``.

        Causal order stays a flag and key padding a (B, 1, 1, Nk) mask, so the
        common cases build no N x N tensor. Hidden keys get ``-inf``; any
        additive bias of an explicit mask is kept.
        """
        visible: Tensor | None
        if self.window is not None or self.document_ids is not None or self.mask is not None:
            visible = self.dense()
            is_causal = False
        else:
            visible = None if self.padding_mask is None else self.padding_mask[:, None, None, :]
            is_causal = self.causal
        if visible is None:
            return None, is_causal
        zero = torch.zeros((), dtype=dtype, device=visible.device)
        additive = torch.where(visible, zero, torch.full((), float("-inf"), dtype=dtype, device=visible.device))
        if self.bias is not None:
            additive = additive + torch.where(visible, self.bias.to(dtype), zero)
        return additive, is_causal

    def restrict_keys(self, keys: Tensor) -> Support:
        """This support with only the keys where ``keys`` (B, Nk) is True left visible.

        Which queries are samples does not change.
        """
        checked = _check_padding("keys", keys, self.num_keys)
        assert checked is not None  # only None for None input
        return self._restricted(checked)

    def _restricted(self, checked: Tensor) -> Support:
        derived = self._derived()
        derived.padding_mask = checked if self.padding_mask is None else self.padding_mask & checked
        derived.batch_size = derived._check_batch_sizes()
        return derived

    def with_window(self, window: int) -> Support:
        """This support intersected with a causal window of the ``window`` most recent keys."""
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise ValueError(f"Expected `window` to be a positive int, got {window!r}.")
        derived = self._derived()
        derived.causal = True
        derived.window = window if self.window is None else min(window, self.window)
        return derived

    def with_documents(self, document_ids: Tensor) -> Support:
        """This support intersected with "same document as the query".

        Documents already in the support are intersected too: two tokens
        share a document only if both partitions say so.
        """
        derived = self._derived()
        derived.document_ids = derived._check_documents(document_ids)
        derived.batch_size = derived._check_batch_sizes()
        if self.document_ids is not None and derived.document_ids is not None:
            if self.document_ids.shape[0] not in (1, derived.document_ids.shape[0]):
                raise ValueError(
                    f"Expected `document_ids` with the batch size of the support's own ({self.document_ids.shape[0]}), "
                    f"got shape {tuple(derived.document_ids.shape)}."
                )
            derived.document_ids = _refine(self.document_ids.to(derived.document_ids.device), derived.document_ids)
        return derived

    def _derived(self) -> Support:
        """A copy to change, without the counts cached for this support."""
        derived = copy.copy(self)
        derived._num_valid = None
        derived._log_counts = {}
        derived._bounds = None
        return derived

    def _device(self) -> torch.device:
        for value in (self.mask, self.padding_mask, self.document_ids, self.query_mask):
            if value is not None:
                return value.device
        return torch.device("cpu")

    def __repr__(self) -> str:
        parts = [f"num_queries={self.num_queries}", f"num_keys={self.num_keys}"]
        if self.padding_mask is not None:
            parts.append("padding_mask")
        if self.causal:
            parts.append("causal")
        if self.window is not None:
            parts.append(f"window={self.window}")
        if self.document_ids is not None:
            parts.append("document_ids")
        if self.mask is not None:
            parts.append("mask" if self.bias is None else "mask+bias")
        return f"Support({', '.join(parts)})"


def _refine(first: Tensor, second: Tensor) -> Tensor:
    """Document ids of the common refinement of two contiguous partitions (B or 1, N)."""
    batch = max(first.shape[0], second.shape[0])
    first, second = first.expand(batch, -1), second.expand(batch, -1)
    change = (first[:, 1:] != first[:, :-1]) | (second[:, 1:] != second[:, :-1])
    return torch.nn.functional.pad(change.long().cumsum(-1), (1, 0))


#: (key mask, causal, window, document ids) of a recognised mask.
_Structure = tuple[Tensor | None, bool, int | None, Tensor | None]


def _recognise(attn_mask: Tensor, length: int) -> _Structure | None:
    """(key mask, causal, window, document ids) of a (B, 1, N|1, N) mask that is exactly such a product.

    Each candidate is checked by exact equality with the mask, so a mask
    with any other pattern is left alone (None).
    """
    # (B, 1, N, N), or (B, 1, 1, N) for a key mask.
    if attn_mask.dim() != 4 or attn_mask.shape[1] != 1 or attn_mask.shape[-2:] not in ((1, length), (length, length)):
        return None
    mask = _compact(attn_mask)
    if mask.dtype == torch.bool:
        visible = mask
    elif mask.dtype.is_floating_point:
        visible = mask > torch.finfo(mask.dtype).min / 2
        # Bool temporaries only: a float copy would be as large as the model's mask.
        if bool(mask.isnan().any()) or bool(((mask != 0) & visible).any()):
            return None  # a bias (or NaN, which the caller rejects), not only a support
    else:
        return None
    visible = visible[:, 0]
    if visible.shape[1] == 1:  # already broadcast over queries: a key mask
        return _keys_or_none(visible[:, 0]), False, None, None
    rows = torch.arange(length, device=visible.device)
    lower = rows[None, :] <= rows[:, None]
    causal = not bool(visible.triu(1).any())
    # (B, N) keys some query sees: under causal order the last query sees them all.
    keys = visible[:, -1] if causal else visible.any(-2)
    candidate = keys[:, None, :] & lower if causal else keys[:, None, :].expand_as(visible)
    if torch.equal(visible, candidate):
        return _keys_or_none(keys), causal, None, None
    if causal:
        keys = visible.any(-2)
    seen = visible.any(-1)
    first = torch.where(seen, visible.to(torch.uint8).argmax(-1), rows)  # (B, N) first visible key per query
    if causal:
        window = int((rows - first).masked_fill(~seen, 0).amax()) + 1
        band = lower & (rows[None, :] > rows[:, None] - window)
        if window < length and torch.equal(visible, band & keys[:, None, :]):
            return _keys_or_none(keys), True, window, None
    # Packed documents: the queries of a document share their first visible key.
    documents = first.cummax(-1).values
    same = documents[:, :, None] == documents[:, None, :]
    candidate = same & keys[:, None, :]
    if causal:
        candidate = candidate & lower
    if torch.equal(visible, candidate):
        return _keys_or_none(keys), causal, None, documents
    return None


#: The last mask recognised and its support: models hand the same mask to every
#: layer (often through a fresh ``detach()`` per call), so it is known by its
#: storage, which the weak reference does not keep alive, its view and its
#: version counter. Layers then share one support, and the counts it caches.
_last_recognised: tuple[weakref.ref[torch.UntypedStorage], tuple, int, Support | None] | None = None


def _structured_once(attn_mask: Tensor, length: int) -> Support | None:
    """The structured support of a recognised mask (:func:`_recognise`), or None.

    The answer for the last mask is reused while that mask is unmodified.
    """
    global _last_recognised
    # Inference tensors (Lightning validates under torch.inference_mode) keep no version
    # counter: an in-place edit could not be seen, so their answer is not reused.
    reuse = not (torch.compiler.is_compiling() or attn_mask.is_inference())
    if reuse:
        storage = attn_mask.untyped_storage()
        view = (attn_mask.storage_offset(), tuple(attn_mask.shape), attn_mask.stride(), attn_mask.dtype, length)
        last = _last_recognised
        if last is not None and last[0]() is storage and last[1] == view and last[2] == attn_mask._version:
            return last[3]
    structure = _recognise(attn_mask, length)
    support = None if structure is None else Support._from_structure(length, structure)
    if reuse:
        _last_recognised = (weakref.ref(storage), view, attn_mask._version, support)
    return support


def _keys_or_none(keys: Tensor) -> Tensor | None:
    """The key mask, or None if every key is visible.

    Copied: a view would keep the model's dense mask alive in the cache.
    """
    return None if bool(keys.all()) else keys.clone()


def _run_bounds(document_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Start and stop (exclusive) of the contiguous run holding each position."""
    length = document_ids.shape[1]
    positions = torch.arange(length, device=document_ids.device).expand_as(document_ids)
    change = torch.ones_like(document_ids, dtype=torch.bool)
    change[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    start = torch.where(change, positions, torch.zeros_like(positions)).cummax(-1).values
    ends = torch.ones_like(change)
    ends[:, :-1] = change[:, 1:]
    stop_at = torch.where(ends, positions + 1, torch.full_like(positions, length))
    stop = stop_at.flip(-1).cummin(-1).values.flip(-1)
    return start, stop


def leading_keys(count: int, padding_mask: Tensor | None, document_ids: Tensor | None, length: int) -> Tensor:
    """(B, length) bool: the first ``count`` real tokens of each sequence, or of each document.

    These are the attention-sink positions a streaming KV cache keeps: with
    left padding the sequence starts at its first real token; in packed
    batches every document has its own.

    Example:
        >>> leading_keys(1, torch.tensor([[0, 1, 1, 1]]), torch.tensor([[0, 0, 1, 1]]), 4)
        tensor([[False,  True,  True, False]])
    """
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ValueError(f"Expected the number of sink positions to be a positive int, got {count!r}.")
    real = _check_padding("padding_mask", padding_mask, length)
    if real is None:
        batch = 1 if document_ids is None else document_ids.shape[0]
        device = None if document_ids is None else document_ids.device
        real = torch.ones(batch, length, dtype=torch.bool, device=device)
    rank = real.long().cumsum(-1)  # 1-based rank of each real token in its row
    if document_ids is not None:
        start, _ = _run_bounds(document_ids)
        before = torch.nn.functional.pad(rank, (1, 0)).gather(1, start)  # real tokens before the document
        rank = rank - before
    return real & (rank <= count)
