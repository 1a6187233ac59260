"""Hugging Face's attention interface: registered kernels, read at ``ALL_ATTENTION_FUNCTIONS``.

Tiny Llama (grouped-query attention, padded) and Gemma 2 (logit soft-cap,
sliding-window layers) models run kernels registered under new names that
compute attention with plain matmul + softmax, never through
``F.scaled_dot_product_attention``. The reference never imports attn_monitor:
an eager twin (same weights) runs with ``output_attentions=True`` and its
weights are pooled over the support the documented masks imply (causal,
key padding, the sliding window).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import math
import warnings
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attn_monitor.capture import AttentionCapture
from attn_monitor.hf_interface import read_interface_call
from tests import reference

transformers = pytest.importorskip("transformers")
from torch.nn.attention.flex_attention import create_block_mask, create_mask, flex_attention  # noqa: E402
from transformers import masking_utils  # noqa: E402
from transformers.integrations import flex_attention as hf_flex  # noqa: E402
from transformers.masking_utils import (  # noqa: E402
    AttentionMaskInterface,
    flash_attention_mask,
    flex_attention_mask,
    sdpa_mask,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface  # noqa: E402

TOL = 1e-4
SPREAD = 0.02
BATCH, SEQ, LAYERS, HEADS = 3, 10, 2, 4
WINDOW, CAP = 4, 2.0


def plain_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention with matmul + softmax; with no mask, causal order and the window, as flash kernels do."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = (query @ key.transpose(-1, -2)) * scaling
    if kwargs.get("softcap"):
        scores = kwargs["softcap"] * torch.tanh(scores / kwargs["softcap"])
    num_q, num_k = scores.shape[-2:]
    rows, cols = torch.arange(num_q)[:, None] + num_k - num_q, torch.arange(num_k)[None, :]
    if attention_mask is None:
        visible = cols <= rows
        if kwargs.get("sliding_window"):
            visible = visible & (cols > rows - kwargs["sliding_window"])
        positions = kwargs.get("position_ids")
        if positions is not None and query.shape[0] == 1:  # packing: positions restart at each document
            documents = torch.cat([torch.zeros(1, dtype=torch.long), (positions[0, 1:] != positions[0, :-1] + 1)])
            documents = documents.long().cumsum(0)
            visible = visible & (documents[:, None] == documents[None, :])
    elif hasattr(attention_mask, "mask_mod"):  # a flex BlockMask: evaluate its mask_mod densely
        batch = query.shape[0]
        visible = create_mask(attention_mask.mask_mod, batch, 1, num_q, num_k, device=str(query.device))
    elif attention_mask.dim() == 2:  # flash-style (batch, keys) padding
        visible = (cols <= rows) & attention_mask[:, None, None, :num_k].bool()
    else:
        visible = attention_mask[..., :num_k].bool()
    # Padding queries outside every window see no key: zero weights there, not NaN.
    probs = scores.masked_fill(~visible, -math.inf).softmax(-1).nan_to_num(0.0)
    return (probs @ value).transpose(1, 2).contiguous(), probs


def sdpa_inside(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """A kernel that calls SDPA itself: seen by the interface and by the SDPA path, counted once."""
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register("test_plain_masked", plain_attention)
AttentionMaskInterface.register("test_plain_masked", sdpa_mask)
AttentionInterface.register("test_plain_unmasked", plain_attention)  # no mask builder: gets None
AttentionInterface.register("test_sdpa_inside", sdpa_inside)
AttentionInterface.register("test_plain_blockmask", plain_attention)  # gets transformers' flex BlockMask
AttentionMaskInterface.register("test_plain_blockmask", flex_attention_mask)
AttentionInterface.register("test_plain_paddingmask", plain_attention)  # gets a padding mask, or packed positions
AttentionMaskInterface.register("test_plain_paddingmask", flash_attention_mask)


@pytest.fixture
def eager_flex(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """transformers' flex_attention path run eagerly: compiling flex and its block masks on CPU takes a minute."""

    def eager(query, key, value, training=False, **kwargs):
        return flex_attention(query, key, value, **kwargs)

    def uncompiled_block_mask(*args, _compile=False, **kwargs):
        return create_block_mask(*args, **kwargs)

    monkeypatch.setattr(hf_flex, "compile_friendly_flex_attention", eager)
    monkeypatch.setattr(masking_utils, "create_block_mask", uncompiled_block_mask)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention.*", category=UserWarning)
        yield


AttentionMaskInterface.register("test_sdpa_inside", sdpa_mask)


def make_model(family: str, implementation: str) -> nn.Module:
    common = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS // 2,
        "vocab_size": 64,
        "max_position_embeddings": 32,
        "initializer_range": 1.0,
        "pad_token_id": 0,
    }
    if family == "llama":
        cls, config = transformers.LlamaForCausalLM, transformers.LlamaConfig(**common)
    else:
        config = transformers.Gemma2Config(
            **common,
            head_dim=8,
            sliding_window=WINDOW,
            attn_logit_softcapping=CAP,
            final_logit_softcapping=None,
            query_pre_attn_scalar=8,
            layer_types=["sliding_attention", "full_attention"],
        )
        cls = transformers.Gemma2ForCausalLM
    torch.manual_seed(0)
    return cls._from_config(copy.deepcopy(config), attn_implementation=implementation).eval()


#: Three packed documents in one row (lengths 9, 7, 6), told by position ids only.
PACKED_POSITIONS = torch.cat([torch.arange(9), torch.arange(7), torch.arange(6)])[None, :]


def make_batch(padded: bool | str) -> dict[str, Tensor]:
    if padded == "packed":
        ids = torch.randint(3, 64, PACKED_POSITIONS.shape, generator=torch.Generator().manual_seed(5))
        return {"input_ids": ids, "position_ids": PACKED_POSITIONS}
    ids = torch.randint(3, 64, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    if padded:  # right padding in one row, left in another: real queries see padding keys only there
        mask[1, 7:] = 0
        mask[2, :4] = 0
    return {"input_ids": ids, "attention_mask": mask}


def expected_means(family: str, batch: dict[str, Tensor]) -> dict[str, tuple[Tensor, Tensor]]:
    """layer -> ((H,) mean, (H,) count) from the eager twin's weights over the documented masks.

    Packed documents (positions restarting at 0) are, by definition, separate
    sequences: each runs through the eager twin alone and the per-head means
    are pooled by their query counts.
    """
    if "position_ids" in batch:
        starts = [int(i) for i in (batch["position_ids"][0] == 0).nonzero()] + [batch["input_ids"].shape[1]]
        parts = [
            expected_means(family, {"input_ids": batch["input_ids"][:, a:b]}) for a, b in itertools.pairwise(starts)
        ]
        pooled = {}
        for name in parts[0]:
            counts = sum(part[name][1] for part in parts)
            sums = sum(part[name][0] * part[name][1] for part in parts)
            pooled[name] = (sums / counts, counts)
        return pooled
    with torch.no_grad():
        attentions = make_model(family, "eager")(**batch, output_attentions=True).attentions
    real = batch["attention_mask"].bool() if "attention_mask" in batch else torch.ones_like(batch["input_ids"]).bool()
    length = batch["input_ids"].shape[1]
    rows, cols = torch.arange(length)[:, None], torch.arange(length)[None, :]
    expected = {}
    for index, probs in enumerate(attentions):
        visible = (cols <= rows) & real[:, None, None, :]
        if family == "gemma2" and index == 0:  # the sliding layer
            visible = visible & (cols > rows - WINDOW)
        expected[f"model.layers.{index}.self_attn"] = reference.head_means(probs, visible, real)
    return expected


def record(model: nn.Module, batch: dict[str, Tensor]) -> tuple[AttentionCapture, Tensor, Tensor]:
    with torch.no_grad(), AttentionCapture(model) as capture:
        with capture.recording(batch.get("attention_mask")):
            monitored = model(**batch).logits
        plain = model(**batch).logits
    return capture, monitored, plain


def interface_entries() -> dict[str, object]:
    return dict(ALL_ATTENTION_FUNCTIONS.items())


@pytest.mark.parametrize(
    ("family", "implementation", "padded"),
    [
        ("llama", "test_plain_masked", True),
        ("llama", "test_plain_unmasked", False),
        ("gemma2", "test_plain_unmasked", False),
        ("gemma2", "test_plain_masked", True),
        ("llama", "test_sdpa_inside", True),
        ("llama", "test_plain_blockmask", True),
        ("gemma2", "test_plain_blockmask", False),
        ("llama", "flex_attention", True),
        ("gemma2", "flex_attention", True),
        ("llama", "test_plain_paddingmask", True),
        ("llama", "test_plain_paddingmask", "packed"),
        ("gemma2", "test_plain_paddingmask", False),
    ],
)
def test_registered_kernel_matches_eager_reference(
    family: str, implementation: str, padded: bool | str, eager_flex: None
) -> None:
    before = interface_entries()
    model = make_model(family, implementation)
    batch = make_batch(padded)
    capture, monitored, plain = record(model, batch)
    assert interface_entries() == before
    assert torch.equal(monitored, plain)
    assert capture.num_calls == LAYERS  # once per layer, also where SDPA runs inside the kernel
    summary = capture.metric.compute()
    expected = expected_means(family, batch)
    assert sorted(summary.layers) == sorted(expected)
    for name, (mean, count) in expected.items():
        assert float(mean.max() - mean.min()) > SPREAD, f"reference heads of {name} barely differ: {mean.tolist()}"
        index = summary.layer_index(name)
        assert summary.count[index, :HEADS].tolist() == count.tolist(), name
        torch.testing.assert_close(summary.mean[index, :HEADS], mean, atol=TOL, rtol=0, msg=name)


def test_sdpa_implementation_counted_once() -> None:
    model = make_model("llama", "sdpa")
    capture, monitored, plain = record(model, make_batch(True))
    assert capture.num_calls == LAYERS
    assert torch.equal(monitored, plain)


def test_interface_restored_after_an_exception() -> None:
    before = interface_entries()
    model = make_model("llama", "test_plain_masked")
    with AttentionCapture(model) as capture, pytest.raises(KeyError), capture.recording():
        assert interface_entries() != before  # wrapped while recording
        raise KeyError("inside")
    assert interface_entries() == before


def test_nested_recordings_restore_in_any_order() -> None:
    before = interface_entries()
    first, second = make_model("llama", "test_plain_masked"), make_model("llama", "test_plain_unmasked")
    batch = make_batch(False)
    with AttentionCapture(first) as one, AttentionCapture(second) as two:
        outer, inner = one.recording(), two.recording()
        outer.__enter__()
        inner.__enter__()
        outer.__exit__(None, None, None)  # the outer one stops first
        with torch.no_grad():
            second(**batch)
            first(**batch)
        assert interface_entries() != before  # the inner one still listens
        inner.__exit__(None, None, None)
    assert interface_entries() == before
    assert (one.num_calls, two.num_calls) == (0, LAYERS)


class OpaqueAttention(nn.Module):
    """A Hugging Face-style attention module; ``route`` says how it reaches its kernel."""

    def __init__(self, route: str) -> None:
        super().__init__()
        self.config = SimpleNamespace(_attn_implementation=route)
        self.is_causal = True
        self.proj = nn.Linear(8, 24)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = (t.view(1, -1, 2, 4).transpose(1, 2) for t in self.proj(x).chunk(3, -1))
        if self.config._attn_implementation == "direct":  # a kernel called around every visible path
            return (q @ k.transpose(-1, -2)).softmax(-1) @ v
        kernel = ALL_ATTENTION_FUNCTIONS.get_interface("test_plain_masked", None)
        # A 3-dim mask: none of the forms transformers' mask builders give.
        return kernel(self, q, k, v, torch.ones(1, x.shape[1], x.shape[1], dtype=torch.bool), scaling=0.5)[0]


@pytest.mark.parametrize(("route", "match"), [("direct", "saw no attention call"), ("interface", "cannot read")])
def test_invisible_paths_are_named(route: str, match: str) -> None:
    model = nn.Sequential(OpaqueAttention(route))
    with AttentionCapture(model) as capture, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with capture.recording(), torch.no_grad():
            model(torch.randn(1, 5, 8))
    messages = [str(w.message) for w in caught if "attn_monitor" in str(w.message)]
    assert len(messages) == 1, messages
    assert match in messages[0] and "'0'" in messages[0]
    assert ("'direct'" if route == "direct" else "'test_plain_masked'") in messages[0] or route == "interface"
    assert capture.num_calls == 0


def test_interface_untouched_outside_recording() -> None:
    model = make_model("llama", "test_plain_masked")
    before = interface_entries()
    with contextlib.ExitStack() as stack:
        stack.enter_context(AttentionCapture(model))
        assert interface_entries() == before


def test_paged_calls_are_refused_with_a_clear_error() -> None:
    """Paged kernels read keys from a cache the call does not show: no support can be rebuilt from the call."""
    module = torch.nn.Module()
    q = k = torch.zeros(1, 2, 3, 4)
    with pytest.raises(ValueError, match="paged or cached"):
        read_interface_call(module, q, k, None, {"cache": object()})
    lengths = torch.tensor([0, 3])
    with pytest.raises(ValueError, match="paged or cached"):
        read_interface_call(module, q, k, None, {"cu_seq_lens_q": lengths, "cu_seq_lens_k": torch.tensor([0, 7])})
    read_interface_call(module, q, k, None, {"cu_seq_lens_q": lengths, "cu_seq_lens_k": lengths})  # packing: read
