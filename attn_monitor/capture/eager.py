"""Probability outputs: attention read from the weights a module returns.

Hugging Face ``eager`` attention returns its probabilities; a forward hook
reads them through an :data:`~attn_monitor.capture.calls.Adapter`.
:func:`probabilities_at` builds one for any module, and
:func:`hf_eager_attention` finds every eager attention module of a Hugging
Face model with where its output holds the weights and which argument holds
its mask. The module signature helpers here also tell the capture whether a
module was given keys of another sequence (cross-attention).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from attn_monitor.capture.calls import Adapter, AttentionCall
from attn_monitor.functional.masks import Support
from attn_monitor.shared.checks import describe

__all__ = [
    "ATTENTION_CLASS",
    "argument",
    "hf_eager_adapter",
    "hf_eager_attention",
    "is_attention_leaf",
    "positions",
    "probabilities_at",
    "takes_other_keys",
]

#: Class names that mark a module as attention (the SDPA path's attribution, eager discovery).
ATTENTION_CLASS = re.compile(r"attention|attn", re.IGNORECASE)
#: Forward arguments through which Hugging Face attention modules take keys from another sequence.
_OTHER_KEYS_ARGS = ("key_value_states", "encoder_hidden_states")
#: Forward arguments holding the mask a Hugging Face eager attention module applies, in order of preference.
_MASK_ARGS = ("attention_mask", "mask", "attn_mask")
#: ``bool_mask`` readings of :func:`probabilities_at`.
_BOOL_MASKS = ("visible", "hidden", "auto")


def probabilities_at(index: int = 1, *, mask_arg: str | None = "attention_mask", bool_mask: str = "visible") -> Adapter:
    """Adapter for modules that return attention probabilities.

    Args:
        index: position of the (batch, heads, query, key) probabilities in the
            module's output tuple; negative counts from the end. Hugging Face
            eager attention: 1 for most families, -1 for the T5 family (whose
            modules return ``(output, position_bias, weights)``).
        mask_arg: forward argument (by keyword or position) holding the mask
            the module applied, broadcastable to the probabilities: bool or
            additive float (``-inf`` or the dtype's minimum hides a key). None,
            or an absent or None argument: every key is visible, or causal
            order if the module has ``is_causal = True``.
        bool_mask: how to read a bool mask: ``"visible"`` (True = the key is
            visible, SDPA's convention), ``"hidden"`` (True = the key is
            hidden, as in ``scores.masked_fill(mask, min)``), or ``"auto"``:
            the reading under which no query that sees a key puts mass on a
            hidden one, decided per call.

    Returns:
        ``adapter(module, args, kwargs, output) -> AttentionCall | None``. The
        adapter raises ValueError when the output does not hold probabilities
        at ``index``, or when no reading of a bool mask fits them.

    Raises:
        TypeError: ``index`` is not an int or ``mask_arg`` not a str.
        ValueError: an unknown ``bool_mask``.

    Example:
        >>> adapter = probabilities_at(1)
        >>> class Eager(torch.nn.Module):
        ...     def forward(self, x):
        ...         return x, torch.full((1, 1, 2, 4), 0.25)
        >>> call = adapter(Eager(), (None,), {}, Eager()(None))
        >>> call.probs.shape, call.support.num_valid().tolist()
        (torch.Size([1, 1, 2, 4]), [[[4, 4]]])
    """
    if not isinstance(index, int) or isinstance(index, bool):
        raise TypeError(f"Expected `index` to be an int, got {type(index).__name__}.")
    if mask_arg is not None and not isinstance(mask_arg, str):
        raise TypeError(f"Expected `mask_arg` to be a str or None, got {type(mask_arg).__name__}.")
    if bool_mask not in _BOOL_MASKS:
        raise ValueError(f"Expected `bool_mask` to be one of {_BOOL_MASKS}, got {bool_mask!r}.")

    def adapter(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> AttentionCall | None:
        if not isinstance(output, (tuple, list)) or not -len(output) <= index < len(output):
            raise ValueError(
                f"Expected the output of {type(module).__name__} to be a tuple with probabilities at index {index}, "
                f"got {describe(output) if not isinstance(output, (tuple, list)) else f'{len(output)} elements'}."
            )
        probs = output[index]
        if probs is None:
            return None
        _check_probabilities(module, index, probs)
        mask = argument(module, mask_arg, args, kwargs) if mask_arg is not None else None
        num_q, num_k = probs.shape[-2:]
        if isinstance(mask, Tensor):
            # Like Hugging Face's eager attention: the first num_k keys (a static cache may be longer).
            mask = mask.detach()[..., -num_q:, :num_k]
            if mask.dtype == torch.bool and bool_mask != "visible":
                mask = ~mask if bool_mask == "hidden" else _bool_reading(module, probs.detach(), mask)
            support = Support(num_q, num_k, mask=mask)
        else:
            support = Support(num_q, num_k, causal=bool(getattr(module, "is_causal", False)))
        return AttentionCall(layer="", support=support, probs=probs.detach())

    return adapter


def _check_probabilities(module: nn.Module, index: int, probs: object) -> None:
    """Raise unless ``probs`` can be (batch, heads, query, key) attention probabilities."""
    where = f"output[{index}] of {type(module).__name__}"
    if not isinstance(probs, Tensor) or probs.dim() != 4 or not probs.dtype.is_floating_point:
        raise ValueError(f"Expected {where} to be (batch, heads, query, key) probabilities, got {describe(probs)}.")
    with torch.no_grad():
        values = probs.detach().float()
        if bool((values < -1e-6).any()):
            raise ValueError(f"Expected {where} to hold probabilities, found negative values (a bias or logits?).")
        if not bool((values > 0).any()):
            raise ValueError(f"Expected {where} to hold probabilities, found no positive value (a zero bias?).")
        # At most 1: learned sinks (softmax over the keys and a sink logit) leave rows below 1, and
        # dropout rescales rows in train mode.
        if not module.training:
            largest = float(values.sum(-1).max())
            tolerance = 1e-3 if probs.dtype in (torch.float32, torch.float64) else 3e-2
            if largest > 1 + tolerance:
                raise ValueError(f"Expected the rows of {where} to sum to at most 1, found a sum of {largest:.4g}.")


def _bool_reading(module: nn.Module, probs: Tensor, mask: Tensor) -> Tensor:
    """Visibility from a bool mask of unknown polarity: the reading the probabilities agree with."""
    has_mass = bool((probs.float().sum(-1) > 1e-3).any())
    for visible in (mask, ~mask):
        if has_mass and not bool(visible.any()):
            continue  # a reading that hides every key cannot be the one the weights came from
        sees = visible.any(-1)
        outside = torch.where(visible, torch.zeros((), device=probs.device), probs.float()).sum(-1)
        if not bool((torch.where(sees, outside, 0.0) > 1e-3).any()):
            return visible
    raise ValueError(
        f"{type(module).__name__} puts attention mass on keys its bool mask hides, whichever way True is read; "
        "pass probabilities_at(..., bool_mask='visible' or 'hidden') or an adapter that builds the support."
    )


#: Positions of forward arguments, per module class (read from the signature once).
_POSITIONS: dict[type, dict[str, int]] = {}


def positions(module: nn.Module) -> dict[str, int]:
    """name -> position of the positional-or-keyword arguments of ``module.forward`` (``self`` excluded)."""
    cls = type(module)
    if cls not in _POSITIONS:
        try:
            parameters = list(inspect.signature(module.forward).parameters.values())
        except (TypeError, ValueError):
            parameters = []
        _POSITIONS[cls] = {
            p.name: i
            for i, p in enumerate(parameters)
            if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        }
    return _POSITIONS[cls]


def argument(module: nn.Module, name: str, args: tuple, kwargs: dict) -> Any:
    """The value ``module.forward`` received for argument ``name`` (None if not given)."""
    if name in kwargs:
        return kwargs[name]
    position = positions(module).get(name)
    return args[position] if position is not None and position < len(args) else None


def takes_other_keys(module: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether ``module`` was called with keys from another sequence than its queries (cross-attention)."""
    if getattr(module, "is_cross_attention", False) is True:
        return True
    return any(argument(module, name, args, kwargs) is not None for name in _OTHER_KEYS_ARGS)


def is_attention_leaf(module: nn.Module) -> bool:
    """A module named as attention with no attention module inside it."""
    if not ATTENTION_CLASS.search(type(module).__name__):
        return False
    return not any(ATTENTION_CLASS.search(type(child).__name__) for child in module.modules() if child is not module)


def _declared_attention_outputs(cls: type) -> list[tuple[type, int]]:
    """(module class, output index) of the attention probabilities a Hugging Face model class declares.

    Transformers models list what ``output_attentions`` collects in
    ``_can_record_outputs``: under keys such as ``attentions`` and
    ``cross_attentions``, a module class (probabilities at ``output[1]``) or a
    recorder naming a ``target_class`` and an ``index``.
    """
    declared = getattr(cls, "_can_record_outputs", None)
    if not isinstance(declared, Mapping):
        return []
    found = []
    for key, specs in declared.items():
        if "attentions" not in str(key):
            continue
        for spec in specs if isinstance(specs, (list, tuple)) else [specs]:
            target = spec if isinstance(spec, type) else getattr(spec, "target_class", None)
            index = 1 if isinstance(spec, type) else getattr(spec, "index", 1)
            if isinstance(target, type) and isinstance(index, int):
                found.append((target, index))
    return found


def hf_eager_attention(model: nn.Module) -> dict[str, tuple[nn.Module, int]]:
    """name -> (module, probabilities index) of every attention leaf under an ``eager`` Hugging Face config.

    The implementation is the nearest enclosing ``config._attn_implementation``:
    attention modules of some families (Bloom, MPT) hold no config, only their
    model does. The index is the one the enclosing models declare for the
    module's class; a declaration on an enclosing wrapper with a negative
    index (the T5 family's ``T5LayerSelfAttention``, index -1) holds for the
    attention module inside it, whose trailing outputs the wrapper passes on.
    Without any declaration: 1, the Hugging Face convention.
    """
    found: dict[str, tuple[nn.Module, int]] = {}

    def visit(module: nn.Module, name: str, implementation: object, declared: list, ancestors: list) -> None:
        own = getattr(getattr(module, "config", None), "_attn_implementation", None)
        implementation = own if isinstance(own, str) else implementation
        declared = declared + _declared_attention_outputs(type(module))
        if name and implementation == "eager" and is_attention_leaf(module):
            direct = [index for target, index in declared if isinstance(module, target)]
            wrapped = [
                index
                for target, index in declared
                if index < 0 and any(isinstance(ancestor, target) for ancestor in ancestors)
            ]
            found[name] = (module, (direct or wrapped or [1])[0])
            return
        for child_name, child in module.named_children():
            visit(child, f"{name}.{child_name}" if name else child_name, implementation, declared, [*ancestors, module])

    visit(model, "", None, [], [])
    return found


def hf_eager_adapter(module: nn.Module, index: int) -> Adapter:
    """``probabilities_at`` for a Hugging Face eager attention module: its own mask argument, either bool polarity."""
    try:
        parameters = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        parameters = {}  # type: ignore[assignment]
    mask_arg = next((name for name in _MASK_ARGS if name in parameters), None)
    return probabilities_at(index, mask_arg=mask_arg, bool_mask="auto")
