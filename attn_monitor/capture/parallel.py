"""Which of a layer's heads a rank computes, so that one sum across ranks counts each (query, head) once.

Under tensor parallelism (``torch.distributed.tensor.parallel``, Lightning's
``ModelParallelStrategy``) each rank of a tensor-parallel group runs the same
batch through a slice of every layer's heads: its attention call shows its
local heads only. :func:`place_heads` says where they sit among the layer's
heads (``head_offset``, ``num_heads`` of an
:class:`~attn_monitor.capture.calls.AttentionCall`), so the metrics keep one row per
global head and every rank writes its slice; a sum over all ranks of any
data x tensor-parallel mesh then counts every (query, head) once, and a
maximum over them is each head's own.

Where the heads come from, in order:

1. q and k that are DTensors (a plan with ``use_local_output=False``): their
   placements. A shard along the sequence (context parallelism) is refused:
   each rank holds part of the keys, and an entropy over local keys has the
   wrong support (merging key shards exactly is
   :func:`~attn_monitor.functional.shards.merge_key_shards`, but the capture cannot
   see the other ranks' keys).
2. A declaration, :func:`declare_heads`, for parallelism PyTorch cannot show
   (plain tensors and hand-written process groups).
3. The DTensor placements of the module's projection weights:
   ``ColwiseParallel`` shards the query projection's rows (``Shard(0)``) over
   one mesh dimension; the rows of this rank are its heads.
4. Nothing parallel: the call holds all of the layer's heads.

Heads that cannot be placed (rows sharded over several mesh dimensions, a
slice that cuts a head, a projection that does not match the call, a
module whose configuration names more heads than its call holds in a
multi-process run with nothing to say where they are) raise a ValueError
naming the layer: never a number that mixes heads.
"""

from __future__ import annotations

import math
import sys
import weakref
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch.distributed as dist
from torch import Tensor, nn

from attn_monitor.capture.calls import AttentionCall
from attn_monitor.shared.checks import check_int

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = ["HeadSlice", "declare_heads", "place_heads"]


@dataclass(frozen=True)
class HeadSlice:
    """Heads ``head_offset ... head_offset + local - 1`` of a layer with ``num_heads`` heads."""

    head_offset: int
    num_heads: int


#: module -> its declared heads; None: another rank counts its calls.
_DECLARED: weakref.WeakKeyDictionary[nn.Module, HeadSlice | None] = weakref.WeakKeyDictionary()


def declare_heads(module: nn.Module, *, head_offset: int, num_heads: int, counted: bool = True) -> None:
    """Declare that this rank's calls of ``module`` hold heads from ``head_offset`` of its ``num_heads``.

    For tensor parallelism PyTorch cannot show (projection weights that are
    plain tensors, hand-written process groups); DTensor plans are read
    without it. ``counted=False`` on all but one rank of a group that runs
    the same batch through the same heads (a layer a tensor-parallel plan
    leaves whole): the others' calls are not counted again. The declaration
    holds as long as the module lives.

    Args:
        module: the attention module (the one whose name the layer has).
        head_offset: the layer's head of this rank's first local head.
        num_heads: the layer's heads on all ranks together.
        counted: whether this rank's calls count (see above).

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.
        ValueError: a negative offset or a non-positive head count.

    Example:
        >>> attention = nn.Linear(4, 4)  # stands in for an attention module holding heads 2-3 of 4
        >>> declare_heads(attention, head_offset=2, num_heads=4)
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"Expected `module` to be a torch.nn.Module, got {type(module).__name__}.")
    heads = HeadSlice(check_int("head_offset", head_offset, 0), check_int("num_heads", num_heads, 1))
    _DECLARED[module] = heads if counted else None


def place_heads(call: AttentionCall, module: nn.Module | None) -> AttentionCall | None:
    """``call`` with its heads placed among its layer's (and DTensor q and k made local).

    Args:
        call: a call as a reader made it.
        module: the module of its layer; None for a call made outside any module.

    Returns:
        The call with ``head_offset`` and ``num_heads`` set; None where
        another rank counts it (DTensor q and k replicated over a mesh
        dimension: the ranks along it hold the same queries; a declaration
        with ``counted=False``).

    Raises:
        ValueError: heads that cannot be placed (see the module docstring), naming the layer.

    Example:
        >>> import torch
        >>> from attn_monitor.functional.masks import Support
        >>> attention = nn.Linear(4, 4)
        >>> declare_heads(attention, head_offset=2, num_heads=4)
        >>> q = torch.randn(1, 2, 3, 8)
        >>> placed = place_heads(AttentionCall("Linear", Support(3, 3), q=q, k=q), attention)
        >>> placed.head_offset, placed.num_heads
        (2, 4)
    """
    local = _local_heads(call)
    if _is_dtensor(call.q) or _is_dtensor(call.k):
        return _place_dtensor_call(call)
    if module is None:
        return call
    if module in _DECLARED:
        heads = _DECLARED[module]
        if heads is None:
            return None
    else:
        heads = _heads_from_weights(call, module, local)
        if heads is None:
            _check_unsharded(call, module, local)
            return call
    if heads.head_offset + local > heads.num_heads:
        raise ValueError(
            f"Layer {call.layer!r}: {local} local heads from head {heads.head_offset} do not fit in its "
            f"{heads.num_heads} heads."
        )
    return replace(call, head_offset=heads.head_offset, num_heads=heads.num_heads)


def _local_heads(call: AttentionCall) -> int:
    held = call.q if call.q is not None else call.probs
    if held is None:
        raise ValueError(f"An AttentionCall of {call.layer!r} holds neither q and k nor probabilities.")
    return held.shape[1]


def _dtensor_type() -> type[DTensor] | None:
    """DTensor, where something has imported it; None otherwise (then no tensor is one, and importing it
    here would cost seconds on the first recorded call)."""
    module = sys.modules.get("torch.distributed.tensor")
    return None if module is None else module.DTensor


def _is_dtensor(value: object) -> bool:
    dtensor = _dtensor_type()
    return dtensor is not None and isinstance(value, dtensor)


def _place_dtensor_call(call: AttentionCall) -> AttentionCall | None:
    """A call whose q and k are DTensors: local tensors, heads placed from the query's placements.

    None on a rank that is not the first along a mesh dimension q is replicated over: that one counts it.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    q, k = call.q, call.k
    if not isinstance(q, DTensor) or not isinstance(k, DTensor):
        raise ValueError(f"Layer {call.layer!r}: its queries and keys must both be DTensors or neither.")
    offset, num_heads, head_dims = 0, q.shape[1], 0
    for value in (q, k):
        for dim, placement in enumerate(value.placements):
            if value.device_mesh.size(dim) == 1:
                continue
            if isinstance(placement, Replicate):
                if value is q and value.device_mesh.get_local_rank(dim) > 0:
                    return None
                continue
            if isinstance(placement, Shard) and placement.dim == 2:
                raise ValueError(
                    f"Layer {call.layer!r}: its {'queries' if value is q else 'keys'} are sharded along the "
                    f"sequence over mesh dimension {dim} (context parallelism): each rank holds part of every "
                    "query's keys, and an entropy over them has the wrong support. attn_monitor cannot read "
                    "such a call; monitor this model without context parallelism (e.g. on a validation pass)."
                )
            if not (isinstance(placement, Shard) and placement.dim in (0, 1)):
                raise ValueError(
                    f"Layer {call.layer!r}: its {'queries' if value is q else 'keys'} are placed as {placement} "
                    f"over mesh dimension {dim}; attn_monitor reads batch or head shards only."
                )
            if value is q and placement.dim == 1:
                head_dims += 1
                offset = _shard_offset(q.shape[1], value.device_mesh.size(dim), value.device_mesh.get_local_rank(dim))
    if head_dims > 1:
        raise ValueError(
            f"Layer {call.layer!r}: its queries' heads are sharded over {head_dims} mesh dimensions; attn_monitor "
            "places heads sharded over one."
        )
    local_q, local_k = q.to_local(), k.to_local()
    return replace(call, q=local_q, k=local_k, head_offset=offset, num_heads=num_heads)


def _shard_offset(size: int, parts: int, index: int) -> int:
    """Where part ``index`` of ``size`` rows split into ``parts`` begins (``torch.chunk``, as DTensor's Shard)."""
    return min(index * math.ceil(size / parts), size)


def _heads_from_weights(call: AttentionCall, module: nn.Module, local: int) -> HeadSlice | None:
    """Heads from the query projection's row sharding (``ColwiseParallel``); None where this rank holds them all."""
    dtensor = _dtensor_type()
    if dtensor is None:
        return None
    from torch.distributed.tensor import Shard

    weights = [(name, p) for name, p in module.named_parameters() if isinstance(p, dtensor)]
    sharded = [(name, p) for name, p in weights if not _whole(p)]
    if not sharded:
        return None
    head_dim = _head_dim(call, module)
    slices, widest = set(), max(weight.shape[0] for _, weight in sharded)
    holds_all = False
    for name, weight in sharded:
        row_dims = [
            dim
            for dim, placement in enumerate(weight.placements)
            if isinstance(placement, Shard) and placement.dim == 0 and weight.device_mesh.size(dim) > 1
        ]
        if weight.dim() != 2 or not row_dims:
            continue  # not a projection to heads (``RowwiseParallel`` shards the output projection's columns)
        rows = weight.shape[0]
        if weight.to_local().shape[0] != local * head_dim:
            # The widest projection with one row per local head and dimension holds every head here: its
            # rows are sharded for storage (FSDP2, read after resharding), not for heads.
            holds_all = holds_all or (rows == widest == local * head_dim)
            continue  # else another projection (grouped-query keys, values of another width)
        if len(row_dims) > 1:
            raise ValueError(
                f"Layer {call.layer!r}: {name} has its rows sharded over mesh dimensions {row_dims}; attn_monitor "
                "places heads sharded over one. Pass the heads with attn_monitor.declare_heads."
            )
        mesh, dim = weight.device_mesh, row_dims[0]
        start = _shard_offset(rows, mesh.size(dim), mesh.get_local_rank(dim))
        if rows % head_dim or start % head_dim:
            raise ValueError(
                f"Layer {call.layer!r}: {name} splits its {rows} rows so that rank rows {start} ... cut a head of "
                f"{head_dim}; its heads cannot be placed."
            )
        slices.add(HeadSlice(start // head_dim, rows // head_dim))
    if not slices and holds_all:
        return None
    if len(slices) != 1:
        found = "no sharded projection matches" if not slices else f"projections disagree ({sorted(slices, key=str)})"
        raise ValueError(
            f"Layer {call.layer!r} has DTensor weights sharded over a device mesh, but {found} its {local} local "
            f"heads of dimension {head_dim}; its heads cannot be placed. Pass them with attn_monitor.declare_heads."
        )
    return slices.pop()


def _whole(weight: Tensor) -> bool:
    """Whether every mesh dimension leaves the DTensor ``weight`` whole on this rank."""
    from torch.distributed.tensor import Replicate

    mesh, placements = weight.device_mesh, weight.placements  # type: ignore[attr-defined]
    return all(mesh.size(dim) == 1 or isinstance(placement, Replicate) for dim, placement in enumerate(placements))


def _head_dim(call: AttentionCall, module: nn.Module) -> int:
    if call.q is not None:
        return call.q.shape[-1]
    head_dim = getattr(module, "head_dim", None)
    if not isinstance(head_dim, int):
        raise ValueError(
            f"Layer {call.layer!r} returns probabilities from DTensor-sharded weights and has no integer "
            "`head_dim` to place its heads by. Pass them with attn_monitor.declare_heads."
        )
    return head_dim


def _check_unsharded(call: AttentionCall, module: nn.Module, local: int) -> None:
    """In a multi-process run, refuse a call that holds fewer heads than its module's configuration names."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return
    config = getattr(module, "config", None)
    configured = getattr(config, "num_attention_heads", None)
    if isinstance(configured, int) and configured > local:
        raise ValueError(
            f"Layer {call.layer!r}: its call holds {local} heads but its configuration names {configured}, "
            "and neither DTensor weights nor a declaration say which of them this rank computes. Pass them with "
            "attn_monitor.declare_heads."
        )
