"""Capture: per-query attention entropy out of real models, on demand.

An :class:`AttentionCapture` finds the attention of a model and, while it is
recording, turns every attention call into an :class:`AttentionCall` (queries
and keys, or probabilities, plus the support the model's own mask implies)
and feeds it to the consumers chosen when the recording starts
(``recording(..., consumers=[...])``; by default one :class:`EntropyUpdate`
of the capture's :class:`~attn_monitor.metrics.entropy.AttentionEntropy`). Paths,
chosen per call:

1. **SDPA**: a ``TorchFunctionMode`` sees every
   ``F.scaled_dot_product_attention`` call (Hugging Face ``sdpa`` models,
   nanoGPT-style models) and reads q, k, ``attn_mask``, ``is_causal``,
   ``scale`` and grouped-query keys. Each call belongs to the innermost
   attention module running at the time (forward pre/post hooks keep a
   stack).
2. **nn.MultiheadAttention** (alone or in ``nn.Transformer*`` layers): the
   same mode sees ``F.multi_head_attention_forward`` and recomputes q and k
   from its input projection. The module's own call is not changed.
3. **Eager softmax inputs**: while a Hugging Face ``eager`` attention module
   runs (found automatically, see :class:`AttentionCapture`), the same mode
   sees the softmax over the keys it calls; its input, the logits with every
   mask the module applied, gives the support, entropy and max logit
   (:mod:`attn_monitor.capture.softmax`).
4. **Probability outputs**: modules whose output holds the attention
   probabilities are read by a forward hook through an adapter;
   :func:`probabilities_at` builds one, and any callable with the
   :data:`Adapter` signature is accepted for other modules. Eager modules
   with no softmax the mode can tie to them are read this way.
5. **FlexAttention**: the same mode sees ``flex_attention``'s operator and
   reads q, k, the scale, the block mask (the support, see
   :func:`~attn_monitor.functional.flex.block_mask_support`) and the ``score_mod``,
   whose modified logits the entropy is taken of.
6. **Hugging Face's attention interface**: while recording, every function
   of ``ALL_ATTENTION_FUNCTIONS`` is wrapped (:mod:`attn_monitor.capture.hf_interface`):
   flash, flex and registered kernels are read where they are called
   (paged ones are refused: their keys sit in a cache the call does not
   show). A call that path 1 or 5 sees inside the kernel is counted once,
   by that path. An attention module of a Hugging Face model that ran
   without any call being read gets one warning naming it and its
   ``attn_implementation``.

Entropy of q/k calls is computed with the fused logsumexp identity
(:func:`~attn_monitor.functional.entropy.entropy_from_qk`), in float32, right after
each call; nothing is kept past the update. Under ``torch.compile`` the
mode is traced and calls are processed when recording stops.

Which keys are visible comes from the mask the model actually used. Which
queries are samples is decided per call, from the sequence its queries come
from, never by matching lengths:

* A call is **self-attention** when its keys are its query tokens: the
  attention module was given no keys from another sequence (Hugging Face's
  ``key_value_states`` / ``encoder_hidden_states`` arguments, or a module
  with ``is_cross_attention = True``; for ``nn.MultiheadAttention``, the
  same tensor as query and key) and as many keys as queries. Anything else
  is **cross-attention** (also a cached decoding step whose keys run past
  its queries).
* The recording's padding mask, when one applies to the call's layer (see
  :meth:`AttentionCapture.recording`), marks the real queries.
* Otherwise a self-attention call's queries are real where the call's own
  mask shows the same token as a key somebody may see (key padding); a
  cross-attention call counts every query that sees a key.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from attn_monitor.capture import hf_interface
from attn_monitor.capture.batches import default_document_ids, default_padding_mask
from attn_monitor.capture.calls import Adapter, AttentionCall, Consumer
from attn_monitor.capture.consumers import EntropyUpdate
from attn_monitor.capture.eager import (
    ATTENTION_CLASS,
    hf_eager_adapter,
    hf_eager_attention,
    is_attention_leaf,
    positions,
    takes_other_keys,
)
from attn_monitor.capture.mha import MHA_ARGS, mha_call
from attn_monitor.capture.parallel import place_heads
from attn_monitor.capture.softmax import SoftmaxReader, softmax_logits
from attn_monitor.functional.entropy import Method
from attn_monitor.functional.flex import is_flex_attention, read_flex_call
from attn_monitor.functional.masks import Support
from attn_monitor.metrics.entropy import AttentionEntropy
from attn_monitor.shared.checks import WarnOnce, describe, matches
from attn_monitor.shared.names import named_layers

__all__ = ["AttentionCapture", "default_document_ids", "default_padding_mask"]

_SDPA = F.scaled_dot_product_attention
_MHA_FORWARD = F.multi_head_attention_forward
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
#: Placeholder layers of calls made outside any known attention module.
_UNOWNED_SDPA, _UNOWNED_MHA, _UNOWNED_FLEX = "\0sdpa", "\0mha", "\0flex"
_UNOWNED = (_UNOWNED_SDPA, _UNOWNED_MHA, _UNOWNED_FLEX)


def _bind(names: tuple[str, ...], args: tuple, kwargs: dict) -> dict[str, Any]:
    bound = dict(zip(names, args, strict=False))
    bound.update(kwargs)
    return bound


def _sdpa_call(layer: str, bound: dict[str, Any]) -> AttentionCall:
    q, k = bound["query"].detach(), bound["key"].detach()
    mask = bound.get("attn_mask")
    support = Support.from_sdpa(
        q.shape[-2], k.shape[-2], None if mask is None else mask.detach(), bool(bound.get("is_causal", False))
    )
    if q.dim() != 4:  # SDPA also takes (heads, seq, dim); give it a batch dim.
        q, k = q.reshape(-1, *q.shape[-3:]), k.reshape(-1, *k.shape[-3:])
    return AttentionCall(layer=layer, support=support, q=q, k=k, scale=bound.get("scale"))


class _CaptureMode(TorchFunctionMode):
    """Sees SDPA and MHA calls; everything else passes straight through."""

    def __init__(self, capture: AttentionCapture) -> None:
        super().__init__()
        self._capture = capture

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        capture = self._capture
        if func is _SDPA:
            with capture._contained(capture._innermost(_UNOWNED_SDPA)):
                capture._on_sdpa(_bind(_SDPA_ARGS, args, kwargs))
        elif func is _MHA_FORWARD:
            with capture._contained(capture._innermost(_UNOWNED_MHA)):
                capture._on_mha(_bind(MHA_ARGS, args, kwargs))
        elif is_flex_attention(func):
            with capture._contained(capture._innermost(_UNOWNED_FLEX)):
                capture._on_flex(args, kwargs)
        elif capture._softmax.active and (logits := softmax_logits(func, args, kwargs)) is not None:
            probs = func(*args, **kwargs)
            capture._softmax.on_softmax(logits, probs)
            return probs
        return func(*args, **kwargs)


class AttentionCapture:
    """Record attention calls of ``model`` while recording; feed them to consumers.

    Use it as a context manager (attach on enter, detach on exit) or call
    :meth:`attach` / :meth:`detach`. While attached, forward hooks sit on the
    attention modules (pass-through unless recording); nothing else about the
    model changes. Entropy is recorded only inside :meth:`recording`.

    Args:
        model: the model (any ``nn.Module``; names are relative to it).
        metric: the :class:`AttentionEntropy` to update; a new one by default.
        layers: optional patterns (``fnmatch`` globs or exact qualified names)
            selecting which layers to record; others are ignored.
        adapters: module name pattern -> :data:`Adapter` for modules whose
            output holds probabilities (or anything else an adapter can read).
            Hugging Face models running ``eager`` attention are read
            automatically: every attention module (class name with
            "Attention"/"Attn", none inside it) under a module whose
            ``config._attn_implementation`` is ``"eager"`` (also modules that
            hold no config themselves, as in Bloom and MPT). Each is read from
            the one softmax over the last dim of a (batch, heads, query, key)
            tensor it calls (:mod:`attn_monitor.capture.softmax`); in eval mode the
            weights it returns are checked against that softmax's output.
            Without one such softmax: its probabilities at the index the
            model declares for its ``attentions`` outputs
            (``_can_record_outputs``; 1 where it declares none), its mask
            from the forward argument named ``attention_mask`` or ``mask``, a
            bool mask read in the polarity its probabilities agree with. A
            module whose output does not hold probabilities there is skipped
            with a warning that names it.
        method: entropy path for q/k calls (see :func:`entropy_from_qk`).
        errors: what an error while reading or measuring a call does:
            ``"raise"`` (default) raises it again, of its type where it
            allows, naming the layer and its module class; ``"warn"`` skips that
            call, counts it per layer in :attr:`skipped` and warns once per
            layer, so that monitoring never stops the model's own work (the
            Lightning callback records this way).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or bad adapters.
        ValueError: an adapter pattern that matches no module.

    Example:
        >>> import torch
        >>> class Tiny(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.attn = torch.nn.MultiheadAttention(8, 2, batch_first=True)
        ...
        ...     def forward(self, x):
        ...         return self.attn(x, x, x, need_weights=False)[0]
        >>> model = Tiny()
        >>> with AttentionCapture(model) as capture, capture.recording():
        ...     _ = model(torch.randn(2, 5, 8))
        >>> summary = capture.metric.compute()
        >>> summary.layers, summary.num_heads, int(summary.count.sum())
        (['attn'], [2], 20)
    """

    def __init__(
        self,
        model: nn.Module,
        metric: AttentionEntropy | None = None,
        *,
        layers: Iterable[str] | None = None,
        adapters: Mapping[str, Adapter] | None = None,
        method: Method = "auto",
        errors: str = "raise",
    ) -> None:
        if errors not in ("raise", "warn"):
            raise ValueError(f"Expected `errors` to be 'raise' or 'warn', got {errors!r}.")
        if not isinstance(model, nn.Module):
            raise TypeError(f"Expected `model` to be a torch.nn.Module, got {type(model).__name__}.")
        if metric is not None and not isinstance(metric, AttentionEntropy):
            raise TypeError(f"Expected `metric` to be an AttentionEntropy, got {type(metric).__name__}.")
        self.model = model
        self.metric = metric if metric is not None else AttentionEntropy()
        self.method = method
        self.layers = None if layers is None else list(layers)
        if self.layers is not None and not all(isinstance(p, str) for p in self.layers):
            raise TypeError(f"Expected `layers` to be patterns (str), got {self.layers!r}.")
        self.consumers: list[Consumer] = [EntropyUpdate(self.metric, method=method)]
        # Layer names as the unwrapped model has them (no `_orig_mod.`, `module.`, ...): see attn_monitor.shared.names.
        named = list(named_layers(model))
        self._layers = dict(named)
        self._names = {id(module): name for name, module in named}
        # The model itself has the empty name; its layer is called by its class.
        self._param_owner = {
            id(module.in_proj_weight if module.in_proj_weight is not None else module.q_proj_weight): name
            or type(module).__name__
            for name, module in named
            if isinstance(module, nn.MultiheadAttention)
        }
        #: Hugging Face eager attention found automatically -> where its output holds the probabilities.
        self._automatic: dict[str, int] = {}
        self._adapters = self._resolve_adapters(adapters or {})
        self._owners = self._attention_owners()
        for module in self._owners.values():
            positions(module)  # read signatures now, not while a compiled forward is traced
        self._decoders = self._decoder_scopes()
        self._handles: list[RemovableHandle] = []
        #: (layer, keys from another sequence) of the attention modules running now, innermost last.
        self._stack: list[tuple[str, bool]] = []
        self._mode = _CaptureMode(self)
        self._recording = False
        self._pending: list[tuple[AttentionCall, str]] = []
        self._query_masks: list[tuple[str | None, Tensor]] = []
        self._document_ids: Tensor | None = None
        self._unowned = 0
        self._warn_once = WarnOnce()
        self._softmax = SoftmaxReader(self._automatic, self._warn_once)
        self._consumers: list[Consumer] = []
        #: Calls seen inside each Hugging Face attention-interface call running now, innermost last.
        self._interface_frames: list[int] = []
        #: Hugging Face attention leaves -> their attn_implementation, for the unreadable-path warning.
        self._hf_leaves = {
            name: implementation
            for name, module in self._owners.items()
            if isinstance(implementation := getattr(getattr(module, "config", None), "_attn_implementation", None), str)
            and is_attention_leaf(module)
        }
        self._ran: set[str] = set()
        self._read: set[str] = set()
        self.errors = errors
        #: Layer -> calls skipped after an error (``errors="warn"``).
        self.skipped: dict[str, int] = {}
        #: Layer -> the paths its calls were read by (``sdpa``, ``flex``, ``eager softmax``...).
        self.paths: dict[str, set[str]] = {}
        self.num_calls = 0
        self.num_recordings = 0

    # -- discovery ---------------------------------------------------------
    def _resolve_adapters(self, adapters: Mapping[str, Adapter]) -> dict[str, Adapter]:
        resolved: dict[str, Adapter] = {}
        for pattern, adapter in adapters.items():
            if not callable(adapter):
                raise TypeError(f"Expected the adapter for {pattern!r} to be callable, got {type(adapter).__name__}.")
            matched = [name for name in self._names.values() if name and matches(name, pattern)]
            if not matched:
                raise ValueError(f"Adapter pattern {pattern!r} matches no module of {type(self.model).__name__}.")
            resolved.update(dict.fromkeys(matched, adapter))
        # Hugging Face eager attention, anywhere inside ``model`` (a LightningModule, a wrapper).
        for module, index in hf_eager_attention(self.model).values():
            name = self._names[id(module)]
            if name not in resolved:
                resolved[name] = hf_eager_adapter(module, index)
                self._automatic[name] = index
        return resolved

    def _decoder_scopes(self) -> list[str]:
        """Names of the decoders of encoder-decoder models: their queries are not the model's input tokens."""
        scopes = []
        for module in self.model.modules():
            decoder: object = None
            if isinstance(module, nn.Transformer):
                decoder = module.decoder
            elif getattr(getattr(module, "config", None), "is_encoder_decoder", False) is True:
                get_decoder = getattr(module, "get_decoder", None)
                decoder = get_decoder() if callable(get_decoder) else getattr(module, "decoder", None)
            if isinstance(decoder, nn.Module) and decoder is not module and id(decoder) in self._names:
                scopes.append(self._names[id(decoder)])
        return scopes

    def _in_decoder(self, layer: str) -> bool:
        return any(layer == scope or layer.startswith(scope + ".") for scope in self._decoders)

    def _attention_owners(self) -> dict[str, nn.Module]:
        """Modules that may call SDPA: attention by class name, not MHA (the mode sees MHA)."""
        return {
            name or type(module).__name__: module
            for name, module in self._layers.items()
            if name not in self._adapters
            and not isinstance(module, nn.MultiheadAttention)
            and ATTENTION_CLASS.search(type(module).__name__)
        }

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    # -- lifecycle ---------------------------------------------------------
    def attach(self) -> AttentionCapture:
        """Register the hooks (idempotent). Returns self."""
        if self._handles:
            return self
        try:
            for name, module in self._owners.items():
                self._handles.append(module.register_forward_pre_hook(self._push(name), with_kwargs=True))
                self._handles.append(module.register_forward_hook(self._pop(name), always_call=True))
            for name, adapter in self._adapters.items():
                module = self._layers[name]
                if name in self._automatic:
                    self._handles.append(module.register_forward_pre_hook(self._enter_eager(name)))
                hook = self._adapter_hook(name, adapter)
                self._handles.append(module.register_forward_hook(hook, with_kwargs=True))
        except BaseException:
            self.detach()
            raise
        return self

    def detach(self) -> None:
        """Remove every hook, newest first. Removing twice is harmless."""
        while self._handles:
            self._handles.pop().remove()
        self._stack.clear()

    def __enter__(self) -> AttentionCapture:
        return self.attach()

    def __exit__(self, *exc: object) -> None:
        self.detach()

    @property
    def num_hooks(self) -> int:
        return len(self._handles)

    # -- recording ---------------------------------------------------------
    @contextmanager
    def recording(
        self,
        padding_mask: Tensor | Mapping[str, Tensor] | None = None,
        document_ids: Tensor | None = None,
        *,
        consumers: Iterable[Consumer] | None = None,
    ) -> Iterator[AttentionCapture]:
        """Record every attention call made inside the block.

        Args:
            padding_mask: which queries are real tokens, for the calls whose
                queries come from the masked sequence. Either one (batch, seq)
                bool or 0/1 mask, True for real tokens, of the model's input
                sequence: it applies to every layer except those inside the
                decoder of an encoder-decoder model (Hugging Face models with
                ``config.is_encoder_decoder``, ``nn.Transformer``). Or a
                mapping from layer name pattern (glob or exact name) to such a
                mask: each layer takes the mask of the first pattern it
                matches, e.g. ``{"*decoder*": decoder_mask, "*": source_mask}``
                (the mask of a cross-attention layer is its queries', the
                decoder's). A layer no mask applies to counts the queries its
                own call shows as real (see the module docstring); a mask
                whose length is not the call's number of queries is not used
                for that layer, with a warning. None: no layer has a mask.
            document_ids: (batch, seq) integer document of each token, for
                packed batches; passed on to consumers (cross-document
                leakage, per-document sinks). The support still comes from
                the model's own mask.
            consumers: who receives this recording's calls, e.g.
                ``[EntropyUpdate(validation_metric), diagnostics]``: chosen
                here, for this recording only. None: :attr:`consumers` (by
                default one :class:`EntropyUpdate` of :attr:`metric`).

        Raises:
            RuntimeError: the capture is not attached, or already recording.
            TypeError: a consumer that is not callable.
        """
        if not self._handles and (self._owners or self._adapters):
            raise RuntimeError("Attach the capture (`with AttentionCapture(model) as capture:`) before recording.")
        if self._recording:
            raise RuntimeError("This capture is already recording; recordings do not nest.")
        query_masks = _query_masks(padding_mask)
        if document_ids is not None and (not isinstance(document_ids, Tensor) or document_ids.dim() != 2):
            raise ValueError(f"Expected `document_ids` with shape (batch, seq), got {describe(document_ids)}.")
        chosen = list(self.consumers if consumers is None else consumers)
        for consumer in chosen:
            if not callable(consumer):
                raise TypeError(f"Expected every consumer to be callable, got {type(consumer).__name__}.")
        self._consumers = chosen
        self._query_masks = query_masks
        self._document_ids = None if document_ids is None else document_ids.detach()
        self.num_recordings += 1
        self._recording = True
        self._stack.clear()
        self._unowned = 0
        self._ran.clear()
        self._read.clear()
        try:
            with self._mode, hf_interface.listening(_InterfaceListener(self)):
                yield self
            self._flush()
            self._warn_unread()
        finally:
            self._recording = False
            self._interface_frames.clear()
            self._pending.clear()
            self._query_masks = []
            self._document_ids = None
            self._consumers = []
            self._stack.clear()
            self._softmax.clear()

    def _push(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if self._recording:
                self._stack.append((name, takes_other_keys(module, args, kwargs)))
                self._ran.add(name)

        return hook

    def _pop(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if self._recording and self._stack and self._stack[-1][0] == name:
                self._stack.pop()

        return hook

    def _enter_eager(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple) -> None:
            if self._recording and not torch.compiler.is_compiling():
                self._softmax.enter(name, module)

        return hook

    def _adapter_hook(self, name: str, adapter: Adapter) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            frame = self._softmax.leave(module) if name in self._automatic else None
            if not self._recording or not self._selected(name):
                return
            with self._contained(name):
                call = None if frame is None else self._softmax.read(frame, output)
                if call is None:
                    self._read_adapter(name, adapter, module, args, kwargs, output)
                else:
                    self._accept(name, module, args, kwargs, call, "eager softmax")

        return hook

    def _read_adapter(
        self, name: str, adapter: Adapter, module: nn.Module, args: tuple, kwargs: dict, output: Any
    ) -> None:
        try:
            call = adapter(module, args, kwargs, output)
        except ValueError as error:
            if name not in self._automatic:
                raise
            self._warn_once(
                f"unreadable:{name}",
                f"attn_monitor cannot read the attention probabilities of {name!r} "
                f"({type(module).__name__}): {error} Pass "
                f"`adapters={{{name!r}: probabilities_at(index, mask_arg=...)}}` with where its output holds "
                "them, or run the model with attn_implementation='sdpa'; this layer is skipped.",
            )
            return
        if call is not None:
            self._accept(name, module, args, kwargs, call, "eager output" if name in self._automatic else "adapter")
        elif name in self._automatic:
            self._warn_once(
                f"no-probabilities:{name}",
                f"attn_monitor saw no attention in {name!r} ({type(module).__name__}): its "
                f"output[{self._automatic[name]}] holds no probabilities and no softmax over its keys ran inside "
                f"it. Run the model with output_attentions=True, or pass `adapters={{{name!r}: your_adapter}}`; "
                "this layer is skipped.",
            )

    def _accept(self, name: str, module: nn.Module, args: tuple, kwargs: dict, call: AttentionCall, path: str) -> None:
        """Receive an eager module's call under its name, self-attention decided as the module docstring says."""
        if call.self_attention is None:
            num_q, num_k = call.support.num_queries, call.support.num_keys
            call = replace(call, self_attention=num_q == num_k and not takes_other_keys(module, args, kwargs))
        self._receive(replace(call, layer=name), path)

    def _innermost(self, unowned: str) -> str:
        """The attention module running now (the owner of a call made here), else ``unowned``."""
        return self._stack[-1][0] if self._stack else unowned

    @contextmanager
    def _contained(self, layer: str) -> Iterator[None]:
        """Run the block; an error in it names the layer and its class, and with ``errors="warn"`` skips the call.

        Skipped calls are counted per layer in :attr:`skipped` and named once.
        """
        if torch.compiler.is_compiling():
            yield
            return
        try:
            yield
        except Exception as error:
            name = layer.strip(chr(0))
            if self.errors == "raise":
                if hasattr(error, "attn_monitor_layer"):
                    raise  # named already, by a block inside this one
                raise _named(error, f"{name!r} ({self._module_class(name)})") from error
            if self._interface_frames:
                self._interface_frames[-1] += 1  # handled (skipped) here: the interface must not read it again
            self.skipped[name] = self.skipped.get(name, 0) + 1
            self._warn_once(
                f"failed:{name}",
                f"attn_monitor could not record a call of {name!r} ({type(error).__name__}: {error}), "
                f"{self._module_class(name)}; such calls are skipped and counted in `skipped`, and the model runs on.",
            )

    def _module_of(self, name: str) -> nn.Module | None:
        """The module of layer ``name`` (the model itself goes by its class name); None for calls outside any."""
        return self._layers.get(name, self.model if name == type(self.model).__name__ else None)

    def _module_class(self, name: str) -> str:
        """How errors name the module of layer ``name``: its class, or that it has none."""
        module = self._module_of(name)
        if module is None:
            return "made outside any attention module"
        return f"module class {type(module).__name__}"

    def _selected(self, name: str) -> bool:
        return self.layers is None or any(matches(name, pattern) for pattern in self.layers)

    # Under torch.compile these run while the graph is traced: they only read
    # state and append to a list, so switching recording on costs one extra
    # graph, not a recompile per call. Counting and naming happen in _flush.
    def _on_sdpa(self, bound: dict[str, Any]) -> None:
        if not self._recording:
            return
        layer, other_keys = self._stack[-1] if self._stack else (_UNOWNED_SDPA, False)
        if layer == _UNOWNED_SDPA or self._selected(layer):
            call = _sdpa_call(layer, bound)
            num_q, num_k = call.support.num_queries, call.support.num_keys
            self._receive(replace(call, self_attention=num_q == num_k and not other_keys), "sdpa")

    def _on_mha(self, bound: dict[str, Any]) -> None:
        if not self._recording:
            return
        weight = bound["q_proj_weight"] if bound.get("use_separate_proj_weight") else bound["in_proj_weight"]
        layer = self._param_owner.get(id(weight), _UNOWNED_MHA)
        if layer == _UNOWNED_MHA or self._selected(layer):
            call = mha_call(layer, bound)
            if call is None:
                self._warn_once(
                    f"mha-extra-keys:{layer}",
                    f"attn_monitor: {layer.strip(chr(0))!r} uses add_bias_kv, add_zero_attn or static_k, which "
                    "capture does not support; this layer is skipped.",
                )
            else:
                same = bound["query"] is bound["key"] and call.support.num_queries == call.support.num_keys
                self._receive(replace(call, self_attention=same), "nn.MultiheadAttention")

    def _on_flex(self, args: tuple, kwargs: dict) -> None:
        if not self._recording or torch.compiler.is_compiling():
            return  # traced flex calls are not read (the unread-path warning names the module)
        layer, other_keys = self._stack[-1] if self._stack else (_UNOWNED_FLEX, False)
        if layer == _UNOWNED_FLEX or self._selected(layer):
            q, k, scale, support, score_mod = read_flex_call(args, kwargs)
            same = support.num_queries == support.num_keys and not other_keys
            self._receive(AttentionCall(layer, support, q, k, scale, score_mod=score_mod, self_attention=same), "flex")

    def _on_interface(
        self, module: nn.Module, implementation: str, query: Tensor, key: Tensor, mask: Any, kwargs: dict
    ) -> None:
        """A Hugging Face attention-interface call that no inner path (SDPA, flex) saw."""
        name = self._names[id(module)] or type(module).__name__
        if not self._recording or not self._selected(name):
            return
        try:
            q, k, scale, support, score_mod = hf_interface.read_interface_call(module, query, key, mask, kwargs)
        except ValueError as error:
            self._read.add(name)  # named here; not again as unread
            self._warn_once(
                f"unreadable:{name}",
                f"attn_monitor cannot read {name!r} ({type(module).__name__}, attn_implementation="
                f"{implementation!r}): {error} This layer is skipped; run it with attn_implementation='sdpa' or "
                "'eager' to monitor it.",
            )
            return
        on_stack = self._stack and self._stack[-1][0] == name
        other_keys = self._stack[-1][1] if on_stack else takes_other_keys(module, (), {})
        same = support.num_queries == support.num_keys and not other_keys
        call = AttentionCall(name, support, q, k, scale, score_mod=score_mod, self_attention=same)
        self._receive(call, f"attention interface ({implementation})")

    def _warn_unread(self) -> None:
        """Name the Hugging Face attention modules that ran but whose attention no path could read."""
        for name in sorted(self._ran - self._read):
            implementation = self._hf_leaves.get(name)
            if implementation is None or implementation == "eager" or not self._selected(name):
                continue
            self._warn_once(
                f"unread:{name}",
                f"attn_monitor saw no attention call in {name!r} ({type(self._owners[name]).__name__}, "
                f"attn_implementation={implementation!r}): its "
                "kernel is called neither through torch.nn.functional.scaled_dot_product_attention, flex_attention "
                "nor transformers' ALL_ATTENTION_FUNCTIONS. This layer is not monitored; run it with "
                "attn_implementation='sdpa' or 'eager', or pass an adapter for it.",
            )

    def _receive(self, call: AttentionCall, path: str) -> None:
        if self._interface_frames:
            self._interface_frames[-1] += 1
        self._read.add(call.layer)
        self._pending.append((replace(call, document_ids=self._document_ids), path))
        if not torch.compiler.is_compiling():
            self._flush()

    def _flush(self) -> None:
        while self._pending:
            call, path = self._pending.pop(0)
            if call.layer in _UNOWNED:
                # No attention module around it: named by its order in the forward pass.
                name = f"{call.layer.strip(chr(0))}_call_{self._unowned}"
                self._unowned += 1
                if not self._selected(name):
                    continue
                call = replace(call, layer=name)
            self.num_calls += 1
            self.paths.setdefault(call.layer, set()).add(path)
            with torch.no_grad(), self._contained(call.layer):
                # Tensor parallelism: which of the layer's heads this rank holds.
                placed = place_heads(call, self._module_of(call.layer))
                if placed is None:
                    continue
                call = replace(placed, padding_mask=self._query_mask_of(placed))
                sample = self._samples(call)
                for consumer in self._consumers:
                    consumer(call, sample)

    def _query_mask_of(self, call: AttentionCall) -> Tensor | None:
        """The recording's mask of the sequence this call's queries come from, if one applies to its layer."""
        for pattern, mask in self._query_masks:
            applies = not self._in_decoder(call.layer) if pattern is None else matches(call.layer, pattern)
            if not applies:
                continue
            held = call.probs if call.probs is not None else call.q
            batch = held.shape[0] if held is not None else mask.shape[0]
            if mask.shape[1] != call.support.num_queries or mask.shape[0] != batch:
                self._warn_once(
                    f"query-mask:{call.layer}",
                    f"attn_monitor: the padding mask for {call.layer!r} has shape {tuple(mask.shape)}, but the layer "
                    f"has {call.support.num_queries} queries in a batch of {batch}: its queries do not come from "
                    "that sequence (cross-attention of a decoder, a cached decoding step?). It is not used for this "
                    "layer; pass `padding_mask` as a mapping {layer pattern: mask} to give the layer its own.",
                )
                return None
            return mask
        return None

    def _samples(self, call: AttentionCall) -> Tensor:
        sample = call.support.is_sample()
        real = call.padding_mask
        if real is None and call.self_attention:
            real = _own_tokens(call.support)
        if real is not None:
            sample = sample & real.to(sample.device)[:, None, :]
        return sample


class _InterfaceListener:
    """A recording capture as :func:`~attn_monitor.capture.hf_interface.listening` sees it."""

    def __init__(self, capture: AttentionCapture) -> None:
        self._capture = capture

    def owns(self, module: nn.Module) -> bool:
        return id(module) in self._capture._names

    def interface_enter(self) -> None:
        self._capture._interface_frames.append(0)

    def interface_exit(self) -> int:
        frames = self._capture._interface_frames
        return frames.pop() if frames else 0

    def on_interface(
        self, module: nn.Module, implementation: str, query: Tensor, key: Tensor, mask: Any, kwargs: dict
    ) -> None:
        capture = self._capture
        with capture._contained(capture._names.get(id(module)) or type(module).__name__):
            capture._on_interface(module, implementation, query, key, mask, kwargs)


def _named(error: Exception, layer: str) -> Exception:
    """``error`` again, of its type where it allows, with the layer it happened in and what to do."""
    message = (
        f"attn_monitor could not record a call of {layer}: {error} Leave the layer out with `layers=`, pass an "
        "adapter for it (`adapters=`), or record with errors='warn' to skip such calls."
    )
    try:
        named = type(error)(message)
    except Exception:
        named = RuntimeError(message)
    named.attn_monitor_layer = layer  # type: ignore[attr-defined]
    return named


def _query_masks(padding_mask: object) -> list[tuple[str | None, Tensor]]:
    """``recording``'s ``padding_mask`` as (layer pattern or None for the input sequence, (batch, seq) bool)."""
    if padding_mask is None:
        return []
    if isinstance(padding_mask, Mapping):
        items = list(padding_mask.items())
        if not all(isinstance(pattern, str) for pattern, _ in items):
            raise TypeError(
                f"Expected the keys of `padding_mask` to be layer patterns (str), got {list(padding_mask)!r}."
            )
    else:
        items = [(None, padding_mask)]
    masks = []
    for pattern, mask in items:
        if not isinstance(mask, Tensor) or mask.dim() != 2:
            where = "`padding_mask`" if pattern is None else f"`padding_mask[{pattern!r}]`"
            raise ValueError(f"Expected {where} with shape (batch, seq), got {describe(mask)}.")
        masks.append((pattern, mask.detach().bool()))
    return masks


def _own_tokens(support: Support) -> Tensor | None:
    """(batch, seq) real tokens of a self-attention call: the keys some query may see."""
    if support.mask is None:
        return support.padding_mask  # causal order, windows and documents hide no key from every query
    return support.dense().any(-2).any(-2)


def nothing_captured_message(model: nn.Module) -> str:
    """Why a capture saw no attention, and what to do about it."""
    implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
    hint = f" The model uses attn_implementation={implementation!r};" if implementation else ""
    return (
        f"attn_monitor captured no attention call in {type(model).__name__}. It looks for calls of "
        "torch.nn.functional.scaled_dot_product_attention, flex_attention, nn.MultiheadAttention, every "
        "function of transformers' attention interface (ALL_ATTENTION_FUNCTIONS: sdpa, flash_attention_*, "
        "flex_attention, registered kernels), and modules given `adapters` (Hugging Face eager attention is "
        f"found automatically).{hint} Kernels called around these (a CUDA kernel called directly by the "
        "attention module) cannot be seen: run the monitored model with attn_implementation='sdpa' or 'eager', "
        "or pass an adapter for your attention module."
    )
