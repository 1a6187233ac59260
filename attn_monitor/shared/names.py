"""Layer names as the user's own model has them, whatever wraps it.

``torch.compile``, PEFT, Lightning Fabric and the data-parallel wrappers each
put a module around the model and so a segment into every qualified name:
``_orig_mod.blocks.0.attn``, ``base_model.model.transformer.h.0.attn``,
``_forward_module.blocks.0.attn``, ``module.blocks.0.attn``. The monitor names
a layer without them (:func:`named_layers`), so runs of one model compare
whatever wrapped it, in every logged name, picture, saved summary and
``layers=`` pattern. Wrappers are known by class name (anywhere in the
class's MRO), so nothing here imports PEFT or Lightning.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from torch import nn

__all__ = ["WRAPPER_SEGMENTS", "head_name", "named_layers"]

#: Wrapper class name -> the attribute names under which it holds the wrapped module.
WRAPPER_SEGMENTS: dict[str, frozenset[str]] = {
    "OptimizedModule": frozenset({"_orig_mod"}),  # torch.compile
    "DistributedDataParallel": frozenset({"module"}),  # torch DDP
    "DataParallel": frozenset({"module"}),
    "FullyShardedDataParallel": frozenset({"_fsdp_wrapped_module"}),  # torch FSDP
    "ActivationWrapper": frozenset({"_checkpoint_wrapped_module"}),  # torch's checkpoint_wrapper
    "_FabricModule": frozenset({"_forward_module", "_original_module"}),  # Lightning Fabric
    "_LightningModuleWrapperBase": frozenset({"_forward_module"}),  # Lightning strategies
    "PeftModel": frozenset({"base_model"}),  # PEFT: PeftModel.base_model is the tuner ...
    "BaseTuner": frozenset({"model"}),  # ... and the tuner's model is the user's model
}


def head_name(family: str, layer: str, head: int, statistic: str) -> str:
    """The one name of a per-head value, whichever API logs it: ``{family}_heads/{layer}/head_{h}/{statistic}``.

    Per-layer values are ``{family}/{layer}/{statistic}``; per-head values sit
    in their family's ``_heads`` group, so the main group stays short however
    many heads a model has. Every ``to_dict`` and so every logger (Lightning,
    the Hugging Face Trainer, Fabric, a plain loop) names them here.

    Example:
        >>> head_name("attn_entropy", "blocks.0.attn", 3, "q50")
        'attn_entropy_heads/blocks.0.attn/head_3/q50'
    """
    return f"{family}_heads/{layer}/head_{head}/{statistic}"


def _wrapped_segments(module: nn.Module) -> frozenset[str]:
    """The child names under which ``module``, if it is a known wrapper, holds what it wraps."""
    segments: frozenset[str] = frozenset()
    for cls in type(module).__mro__:
        segments |= WRAPPER_SEGMENTS.get(cls.__name__, frozenset())
    return segments


def named_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``model.named_modules()`` with the segments wrappers insert dropped from every name.

    Each module is yielded once (the first path that reaches it, as
    ``named_modules`` does); what a wrapper holds is named as the wrapper.
    Where two other modules would share a name, both keep their full paths.

    Example:
        >>> import torch
        >>> inner = torch.nn.Sequential(torch.nn.Linear(2, 2))
        >>> wrapped = torch.nn.parallel.DataParallel(inner)
        >>> [name for name, _ in wrapped.named_modules()]
        ['', 'module', 'module.0']
        >>> [name for name, _ in named_layers(wrapped)]
        ['', '', '0']
    """
    entries: list[tuple[str, str, bool, nn.Module]] = []  # (full, short, holds its wrapper's name, module)
    seen: set[int] = set()

    def visit(module: nn.Module, full: str, short: str, wrapped: bool) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        entries.append((full, short, wrapped, module))
        dropped = _wrapped_segments(module)
        for child_name, child in module.named_children():
            child_full = f"{full}.{child_name}" if full else child_name
            if child_name in dropped:
                visit(child, child_full, short, True)
            else:
                visit(child, child_full, f"{short}.{child_name}" if short else child_name, False)

    visit(model, "", "", True)
    # What a wrapper holds shares the wrapper's name; two other modules on one name keep their full paths.
    owners = Counter(short for _, short, wrapped, _ in entries if not wrapped)
    for full, short, _, module in entries:
        yield (full if owners[short] > 1 else short), module
