"""Hugging Face's attention interface: registered kernels, read at ``ALL_ATTENTION_FUNCTIONS``.

Tiny Llama (grouped-query attention, padded) and Gemma 2 (logit soft-cap,
sliding-window layers) models run kernels registered under new names that
compute attention with plain matmul + softmax, never through
``F.scaled_dot_product_attention``. The reference never imports attn_monitor:
an eager twin (same weights) runs with ``output_attentions=True`` and its
weights are pooled over the support the documented masks imply (causal,
key padding, the sliding window). A chunk after a cached prefix is compared
with the twin's rows over the whole sequence, packed documents with each
document run alone.
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

from attn_monitor.capture.hf_interface import read_interface_call
from attn_monitor.capture.hooks import AttentionCapture
from tests.helpers import reference

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
    """Attention with matmul + softmax; with no mask or a (batch, keys) one, what flash kernels do.

    That is causal order with the queries aligned to the end of the keys, the
    window, key padding, and packed documents told by `position_ids` or
    `cu_seq_lens_q`.
    """
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = (query @ key.transpose(-1, -2)) * scaling
    if kwargs.get("softcap"):
        scores = kwargs["softcap"] * torch.tanh(scores / kwargs["softcap"])
    num_q, num_k = scores.shape[-2:]
    rows, cols = torch.arange(num_q)[:, None] + num_k - num_q, torch.arange(num_k)[None, :]
    if hasattr(attention_mask, "mask_mod"):  # a flex BlockMask: evaluate its mask_mod densely
        batch = query.shape[0]
        visible = create_mask(attention_mask.mask_mod, batch, 1, num_q, num_k, device=str(query.device))
    elif attention_mask is None or attention_mask.dim() == 2:  # flash kernels: causal order, window, padding
        visible = cols <= rows
        if kwargs.get("sliding_window"):
            visible = visible & (cols > rows - kwargs["sliding_window"])
        if attention_mask is not None:  # flash-style (batch, keys) padding
            visible = visible & attention_mask[:, None, None, -num_k:].bool()
        positions, lengths = kwargs.get("position_ids"), kwargs.get("cu_seq_lens_q")
        if positions is not None and query.shape[0] == 1:  # packing: positions restart at each document
            documents = torch.cat([torch.zeros(1, dtype=torch.long), (positions[0, 1:] != positions[0, :-1] + 1)])
            documents = documents.long().cumsum(0)
            visible = visible & (documents[:, None] == documents[None, :])
        if lengths is not None:  # packing told by cumulative document lengths, as flash varlen kernels take it
            documents = torch.repeat_interleave(torch.arange(len(lengths) - 1), lengths.diff())
            visible = visible & (documents[:, None] == documents[None, :])
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


def expected_means(family: str, batch: dict[str, Tensor], first_query: int = 0) -> dict[str, tuple[Tensor, Tensor]]:
    """layer -> ((H,) mean, (H,) count) from the eager twin's weights over the documented masks.

    Packed documents (positions restarting at 0) are pooled per document
    (:func:`expected_document_means`). ``first_query``: only the queries from
    that position on count, each seeing every earlier key (the chunk of a
    chunked prefill: the eager twin runs the whole sequence at once).
    """
    if "position_ids" in batch:
        starts = [int(i) for i in (batch["position_ids"][0] == 0).nonzero()]
        return expected_document_means(family, batch["input_ids"], starts)
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
        chunk = slice(first_query, None)
        expected[f"model.layers.{index}.self_attn"] = reference.head_means(
            probs[:, :, chunk], visible[..., chunk, :], real[:, chunk]
        )
    return expected


def expected_document_means(family: str, ids: Tensor, starts: list[int]) -> dict[str, tuple[Tensor, Tensor]]:
    """Packed documents of one row, starting at ``starts``: by definition separate sequences.

    Each runs through the eager twin alone and the per-head means are pooled
    by their query counts.
    """
    bounds = [*starts, ids.shape[1]]
    parts = [expected_means(family, {"input_ids": ids[:, a:b]}) for a, b in itertools.pairwise(bounds)]
    pooled = {}
    for name in parts[0]:
        counts = sum(part[name][1] for part in parts)
        sums = sum(part[name][0] * part[name][1] for part in parts)
        pooled[name] = (sums / counts, counts)
    return pooled


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
    check_against(capture, expected_means(family, batch))


def check_against(capture: AttentionCapture, expected: dict[str, tuple[Tensor, Tensor]]) -> None:
    """Per-head counts equal the reference's and means agree within TOL; the reference tells heads apart."""
    summary = capture.metric.compute()
    assert sorted(summary.layers) == sorted(expected)
    for name, (mean, count) in expected.items():
        assert float(mean.max() - mean.min()) > SPREAD, f"reference heads of {name} barely differ: {mean.tolist()}"
        index = summary.layer_index(name)
        assert summary.count[index, :HEADS].tolist() == count.tolist(), name
        torch.testing.assert_close(summary.mean[index, :HEADS], mean, atol=TOL, rtol=0, msg=name)


#: Chunked prefill: the first PREFIX tokens fill the cache, the rest arrive as one chunk.
PREFIX = 6


@pytest.mark.parametrize(
    ("family", "implementation", "padded"),
    [
        ("llama", "test_plain_unmasked", False),
        ("gemma2", "test_plain_unmasked", False),
        ("llama", "test_plain_paddingmask", True),
        ("gemma2", "test_plain_paddingmask", True),
        ("llama", "test_plain_masked", True),
    ],
)
def test_chunk_after_a_cached_prefix_aligns_queries_to_the_end_of_the_keys(
    family: str, implementation: str, padded: bool
) -> None:
    """A chunk of 4 queries over the 10 keys of the cache and itself: query i of the chunk is token PREFIX + i.

    transformers aligns a chunk's queries to the end of its keys: flash
    kernels are called with ``causal=True`` and no mask, and flash-attn
    (>= 2.1) aligns that causal diagonal bottom-right (transformers'
    ``flash_attn_supports_top_left_mask()`` is False off NPU); mask builders
    put query i at ``cache_position`` PREFIX + i. The chunked model's logits
    equal the full run's, which checks that ``plain_attention`` does the
    same. The reference is the eager twin run over the whole sequence at
    once, its rows from PREFIX on.

    Fails with the causal diagonal of ``_causal_support`` shifted the wrong
    way (aligned top-left: ``rows = arange(num_q)``), on every case without a
    4-dim mask.
    """
    model = make_model(family, implementation)
    batch = make_batch(padded)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    if padded:  # padding inside the cached prefix only: every chunk query is a real token
        mask = torch.ones_like(mask)
        mask[2, :4] = 0
    with torch.no_grad():
        cache = model(input_ids=ids[:, :PREFIX], attention_mask=mask[:, :PREFIX], use_cache=True).past_key_values
        with AttentionCapture(model) as capture, capture.recording():
            chunk = model(input_ids=ids[:, PREFIX:], attention_mask=mask, cache=cache).logits
        full = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(chunk, full[:, PREFIX:], atol=1e-4, rtol=0)
    assert capture.num_calls == LAYERS
    check_against(capture, expected_means(family, {"input_ids": ids, "attention_mask": mask}, first_query=PREFIX))


def test_packing_told_by_cu_seq_lens_counts_each_document_apart() -> None:
    """Three packed documents told by ``cu_seq_lens_q`` / ``cu_seq_lens_k`` alone, as flash varlen kernels take them.

    No ``position_ids`` are passed (the model numbers the row 0..21, one
    document by its positions), so only the lengths tell the documents apart.
    RoPE scores depend on relative positions only: each document run alone
    through the eager twin is the reference.

    Fails when ``read_interface_call`` ignores ``cu_seq_lens_q`` (the whole
    row read as one causal sequence: counts and means both wrong).
    """
    lengths = torch.tensor([9, 7, 6])
    cu_seq_lens = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))
    ids = torch.randint(3, 64, (1, int(lengths.sum())), generator=torch.Generator().manual_seed(5))
    varlen = {"cu_seq_lens_q": cu_seq_lens, "cu_seq_lens_k": cu_seq_lens, "max_length_q": 9, "max_length_k": 9}
    model = make_model("llama", "test_plain_unmasked")
    with torch.no_grad(), AttentionCapture(model) as capture, capture.recording():
        model(input_ids=ids, **varlen)
    assert capture.num_calls == LAYERS
    check_against(capture, expected_document_means("llama", ids, [0, 9, 16]))


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
    # Packing (the same lengths for queries and keys) is read: documents of 2 and 1 tokens, causal within each.
    packed = torch.tensor([0, 2, 3])
    *_, support = read_interface_call(module, q, k, None, {"cu_seq_lens_q": packed, "cu_seq_lens_k": packed})[:4]
    assert support.num_valid().flatten().tolist() == [1, 2, 1]
