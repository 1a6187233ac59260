"""AttentionCapture / evaluate_attention against an independent float64 reference.

The reference never imports attn_monitor:

* Hugging Face models: a second model with the same weights, built from a
  deep copy of the config with ``attn_implementation="eager"`` and run with
  ``output_attentions=True``; its probabilities are restricted to the support
  the batch's ``attention_mask`` implies (padding keys hidden; causal for
  GPT-2 and Llama, not for BERT), renormalised and turned into entropy in
  float64.
* Hand-written models (nanoGPT, packed documents, eager ``Mixer``,
  ``nn.TransformerEncoder``, ``nn.MultiheadAttention``): q and k recomputed
  from the module weights on the inputs a plain forward gives each layer,
  softmax in float64 over the true support.

Pooling (docs/design.md §2-§3): normalised entropy ``H / ln(n)``, token-weighted
mean per (layer, head) over real (non-padding) queries with ``n > 1``.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import math
import time
import warnings
import weakref
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

from attn_monitor.capture.eager import probabilities_at
from attn_monitor.capture.evaluate import evaluate_attention
from attn_monitor.capture.hooks import AttentionCapture
from tests.helpers import models

pytest.importorskip("transformers")

TOL = 1e-4
FAMILIES = ("gpt2", "llama", "bert")
IMPLEMENTATIONS = ("sdpa", "eager")
PADDINGS = ("none", "ones", "right", "left")
LENGTHS = (10, 7, 4)  # one full row, two padded ones
HF_LAYER_NAMES = {
    "gpt2": ["transformer.h.0.attn", "transformer.h.1.attn"],
    "llama": ["model.layers.0.self_attn", "model.layers.1.self_attn"],
    "bert": ["encoder.layer.0.attention.self", "encoder.layer.1.attention.self"],
}
CAUSAL = {"gpt2": True, "llama": True, "bert": False}


# --------------------------------------------------------------------------- reference


def reference_means(probs: Tensor, visible: Tensor, real: Tensor) -> Tensor:
    """(H,) token-weighted mean normalised entropy of one layer.

    Args:
        probs: (B, H, Nq, Nk) attention weights (any values off the support).
        visible: bool, broadcastable to ``probs``: the true support.
        real: (B, Nq) bool, True for real (non-padding) queries.
    """
    probs = probs.to(torch.float64)
    visible = visible.expand(probs.shape)
    p = torch.where(visible, probs, torch.zeros_like(probs))
    p = p / p.sum(-1, keepdim=True).clamp(min=1e-300)  # renormalise over the support
    entropy = -torch.where(p > 0, p * p.log(), torch.zeros_like(p)).sum(-1)
    n = visible.sum(-1)
    counted = real[:, None, :].expand(n.shape) & (n > 1)
    normalised = torch.where(counted, entropy / n.clamp(min=2).to(torch.float64).log(), torch.zeros_like(entropy))
    return normalised.sum((0, 2)) / counted.sum((0, 2)).to(torch.float64)


def probs_from_qk(q: Tensor, k: Tensor, visible: Tensor, bias: Tensor | None = None) -> Tensor:
    """Dense float64 softmax of ``q k^T / sqrt(d) (+ bias)`` over ``visible``; empty rows give 0."""
    q, k = q.to(torch.float64), k.to(torch.float64)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if bias is not None:
        scores = scores + torch.where(torch.isfinite(bias), bias, torch.zeros_like(bias)).to(torch.float64)
    scores = scores.masked_fill(~visible, -math.inf)
    return scores.softmax(-1).nan_to_num(0.0)


def causal_visible(n: int) -> Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()[None, None]


def assert_summary(summary, layers: list[str], expected: list[Tensor]) -> None:
    assert summary.layers == layers
    got = summary.mean
    assert got.shape[0] == len(expected)
    for index, want in enumerate(expected):
        torch.testing.assert_close(got[index, : want.shape[0]], want, atol=TOL, rtol=0, msg=f"layer {layers[index]}")


def total_hooks(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


# --------------------------------------------------------------------------- Hugging Face


def hf_batch(padding: str, seed: int = 0) -> dict[str, Tensor]:
    """Token ids (3, 10) and, except for ``none``, an ``attention_mask``."""
    generator = torch.Generator().manual_seed(seed)
    n = max(LENGTHS)
    ids = torch.randint(1, models.VOCAB, (len(LENGTHS), n), generator=generator)
    if padding == "none":
        return {"input_ids": ids}
    mask = torch.ones(len(LENGTHS), n, dtype=torch.long)
    if padding != "ones":
        for row, length in enumerate(LENGTHS):
            if padding == "right":
                mask[row, length:] = 0
            else:
                mask[row, : n - length] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return {"input_ids": ids, "attention_mask": mask}


def hf_reference(model: nn.Module, family: str, batch: dict[str, Tensor]) -> list[Tensor]:
    """Per-layer (H,) means from an eager twin of ``model`` with ``output_attentions=True``."""
    twin = type(model)._from_config(copy.deepcopy(model.config), attn_implementation="eager")
    twin.load_state_dict(model.state_dict())
    twin.eval()
    assert twin.config is not model.config
    with torch.no_grad():
        attentions = twin(**batch, output_attentions=True).attentions
    ids = batch["input_ids"]
    real = batch.get("attention_mask", torch.ones_like(ids)).bool()
    visible = real[:, None, None, :]
    if CAUSAL[family]:
        visible = visible & causal_visible(ids.shape[1])
    assert len(attentions) == models.LAYERS
    return [reference_means(probs, visible, real) for probs in attentions]


@pytest.mark.parametrize("padding", PADDINGS)
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("family", FAMILIES)
def test_hf_matches_eager_reference(family: str, implementation: str, padding: str) -> None:
    model = models.hf_model(family, implementation)
    batch = hf_batch(padding)
    summary = evaluate_attention(model, [batch])
    assert_summary(summary, HF_LAYER_NAMES[family], hf_reference(model, family, batch))
    assert summary.num_heads == [models.HEADS] * models.LAYERS


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_hf_streaming_batches(implementation: str) -> None:
    """Two batches of different padding accumulate like their union (token-weighted)."""
    model = models.hf_model("llama", implementation)
    batches = [hf_batch("right", seed=1), hf_batch("left", seed=2)]
    summary = evaluate_attention(model, batches)
    # Token-weighted pooling of two batches = concatenation along the batch (same N).
    union = {key: torch.cat([b[key] for b in batches]) for key in batches[0]}
    assert_summary(summary, HF_LAYER_NAMES["llama"], hf_reference(model, "llama", union))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("family", FAMILIES)
def test_hf_config_and_training_flag_unchanged(family: str, implementation: str) -> None:
    model = models.hf_model(family, implementation)
    config_before = model.config.to_dict()
    for training in (True, False):
        model.train(training)
        evaluate_attention(model, [hf_batch("right")])
        assert model.training is training
        assert all(m.training is training for m in model.modules())
        with AttentionCapture(model) as capture, capture.recording(), torch.no_grad():
            model(**hf_batch("left"))
        assert model.training is training
    assert model.config._attn_implementation == implementation
    assert model.config.to_dict() == config_before


@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("padding", ["none", "left"])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("family", FAMILIES)
def test_hf_outputs_bit_identical(family: str, implementation: str, padding: str, mode: str) -> None:
    model = models.hf_model(family, implementation, dropout=0.1 if mode == "train" else 0.0)
    model.train(mode == "train")
    batch = hf_batch(padding)

    def run() -> Tensor:
        torch.manual_seed(1234)
        with torch.set_grad_enabled(mode == "train"):
            return model(**batch)[0]

    plain = run()
    with AttentionCapture(model) as capture:
        attached = run()
        with capture.recording(batch.get("attention_mask")):
            recorded = run()
    after = run()
    assert capture.num_calls == models.LAYERS
    assert torch.equal(plain, attached)
    assert torch.equal(plain, recorded)
    assert torch.equal(plain, after)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("family", FAMILIES)
def test_hf_train_mode_with_attention_dropout(family: str, implementation: str) -> None:
    """Attention dropout must neither break recording nor change the entropy, on either path.

    Only the attention probabilities are dropped (p = 0.5), so layer 0 sees the
    same input as in eval mode and its entropy must equal the eval reference:
    dropout is applied after the softmax, the sdpa path reads q and k, and
    eager attention is read from its softmax's logits, without a warning (the
    returned weights, after dropout, are not compared in train mode). Reading
    the returned probabilities instead fails to match; an explicit
    ``probabilities_at`` adapter still does that: see the next test.
    """
    model = models.hf_model(family, implementation, attention_dropout=0.5)
    batch = hf_batch("right")
    expected = hf_reference(model, family, batch)
    model.train()
    torch.manual_seed(0)
    capture = AttentionCapture(model, layers=[HF_LAYER_NAMES[family][0]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with capture, capture.recording(batch["attention_mask"]):
            model(**batch)
    assert_summary(capture.metric.compute(), HF_LAYER_NAMES[family][:1], expected[:1])


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_train_mode_with_attention_dropout_probabilities_adapter(family: str) -> None:
    """Returned weights are after dropout: recording through an explicit adapter must not break.

    Queries whose whole support was dropped are left out with one warning; the
    rest are renormalised over the support, so every value stays in [0, 1].
    """
    model = models.hf_model(family, "eager", attention_dropout=0.9)
    batch = hf_batch("right")
    model.train()
    torch.manual_seed(0)
    adapters = {name: probabilities_at(1, bool_mask="auto") for name in HF_LAYER_NAMES[family]}
    capture = AttentionCapture(model, adapters=adapters)
    with pytest.warns(UserWarning, match="dropout"), capture, capture.recording(batch["attention_mask"]):
        model(**batch)
    summary = capture.metric.compute()
    assert summary.layers == HF_LAYER_NAMES[family]
    assert (summary.count.sum(-1) > 0).all()
    assert ((summary.mean >= 0) & (summary.mean <= 1)).all()


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_hf_layers_glob(implementation: str) -> None:
    model = models.hf_model("gpt2", implementation)
    batch = hf_batch("right")
    reference = hf_reference(model, "gpt2", batch)
    summary = evaluate_attention(model, [batch], layers=["transformer.h.1.*"])
    assert_summary(summary, ["transformer.h.1.attn"], [reference[1]])
    summary = evaluate_attention(model, [batch], layers=["*.h.0.attn"])
    assert_summary(summary, ["transformer.h.0.attn"], [reference[0]])


# --------------------------------------------------------------------------- nanoGPT and packed documents


def nanogpt_reference(model: models.NanoGPT, idx: Tensor) -> list[Tensor]:
    out = []
    with torch.no_grad():
        x = model.embed(idx)
        for block in model.blocks:
            q, k, _ = block.attn.qkv(block.ln_1(x))
            visible = causal_visible(idx.shape[1])
            out.append(reference_means(probs_from_qk(q, k, visible), visible, torch.ones_like(idx, dtype=torch.bool)))
            x = block(x)
    return out


NANOGPT_LAYERS = ["blocks.0.attn", "blocks.1.attn"]


def tokens(batch: int = 2, n: int = 12, seed: int = 0) -> Tensor:
    return torch.randint(0, models.VOCAB, (batch, n), generator=torch.Generator().manual_seed(seed))


def test_nanogpt_matches_reference() -> None:
    model = models.NanoGPT()
    idx = tokens()
    assert_summary(evaluate_attention(model, [idx]), NANOGPT_LAYERS, nanogpt_reference(model, idx))


def test_nanogpt_train_mode_capture() -> None:
    """Recording in train mode (dropout 0: the reference has no RNG to match) with gradients on."""
    model = models.NanoGPT().train()
    idx = tokens(seed=3)
    with AttentionCapture(model) as capture, capture.recording():
        model(idx).sum().backward()
    assert_summary(capture.metric.compute(), NANOGPT_LAYERS, nanogpt_reference(model, idx))


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_nanogpt_outputs_bit_identical(mode: str) -> None:
    model = models.NanoGPT(dropout=0.1).train(mode == "train")
    idx = tokens()

    def run() -> Tensor:
        torch.manual_seed(99)
        with torch.set_grad_enabled(mode == "train"):
            return model(idx)

    plain = run()
    with AttentionCapture(model) as capture, capture.recording():
        recorded = run()
    assert capture.num_calls == models.LAYERS
    assert torch.equal(plain, recorded)
    assert torch.equal(plain, run())


def packed_batch() -> tuple[Tensor, Tensor]:
    docs = torch.tensor(
        [
            [0, 0, 0, 1, 1, 1, 1, 1, 2, 3, 3, 3],  # a one-token document (2)
            [0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1],
        ]
    )
    return tokens(seed=5), docs


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_packed_documents_match_reference(causal: bool) -> None:
    model = models.PackedLM(causal=causal).eval()
    idx, docs = packed_batch()
    visible = (docs[:, None, :, None] == docs[:, None, None, :]) & (
        causal_visible(idx.shape[1]) if causal else torch.ones((), dtype=torch.bool)
    )
    expected = []
    with torch.no_grad():
        x = model.wte(idx)
        for block in model.blocks:
            q, k, _ = block.attn.qkv(block.ln_1(x))
            expected.append(
                reference_means(probs_from_qk(q, k, visible), visible, torch.ones_like(docs, dtype=torch.bool))
            )
            x = block(x, visible)
    summary = evaluate_attention(model, [(idx, docs)])
    assert_summary(summary, ["blocks.0.attn", "blocks.1.attn"], expected)


def test_packed_documents_outputs_bit_identical() -> None:
    model = models.PackedLM().eval()
    idx, docs = packed_batch()
    with torch.no_grad():
        plain = model(idx, docs)
        with AttentionCapture(model) as capture, capture.recording():
            recorded = model(idx, docs)
    assert torch.equal(plain, recorded)


# --------------------------------------------------------------------------- adapters


def eager_batch(padding: str) -> tuple[Tensor, Tensor]:
    idx = tokens(batch=3, n=10, seed=7)
    real = torch.ones(3, 10, dtype=torch.bool)
    if padding == "right":
        real[1, 6:] = False
        real[2, 3:] = False
    elif padding == "left":
        real[1, :4] = False
        real[2, :7] = False
    return idx, real


@pytest.mark.parametrize("padding", ["none", "right", "left"])
def test_adapter_probabilities_at(padding: str) -> None:
    model = models.EagerLM().eval()
    idx, real = eager_batch(padding)
    visible = causal_visible(10) & real[:, None, None, :]
    expected = []
    with torch.no_grad():
        x = model.wte(idx)
        for block in model.blocks:
            h = block.ln(x)
            q, k, _ = (t.view(3, 10, models.HEADS, -1).transpose(1, 2) for t in block.mixer.qkv(h).split(32, dim=2))
            expected.append(reference_means(probs_from_qk(q, k, visible), visible, real))
            x = block(x, model.mask(real))
    summary = evaluate_attention(
        model,
        [(idx, real)],
        padding_mask=lambda batch: batch[1],
        adapters={"blocks.*.mixer": probabilities_at(1)},
    )
    assert_summary(summary, ["blocks.0.mixer", "blocks.1.mixer"], expected)


def test_without_adapter_custom_eager_attention_is_not_seen() -> None:
    model = models.EagerLM()
    with pytest.raises(RuntimeError, match="adapter"):
        evaluate_attention(model, [eager_batch("none")])


def test_adapter_pattern_matching_nothing() -> None:
    model = models.EagerLM()
    with pytest.raises(ValueError, match="no_such_module"):
        AttentionCapture(model, adapters={"no_such_module.*": probabilities_at(1)})
    with pytest.raises(ValueError, match="no_such_module"):
        evaluate_attention(model, [eager_batch("none")], adapters={"no_such_module": probabilities_at(1)})
    assert total_hooks(model) == 0


# ------------------------------------------------------------ nn.TransformerEncoder / nn.MultiheadAttention


def mha_qk(attn: nn.MultiheadAttention, x: Tensor, batch_first: bool) -> tuple[Tensor, Tensor]:
    """q, k (B, H, N, D) from the packed input projection; ``x`` as the module gets it."""
    if not batch_first:
        x = x.transpose(0, 1)
    w_q, w_k, _ = attn.in_proj_weight.chunk(3)
    b_q, b_k, _ = attn.in_proj_bias.chunk(3)
    batch, n, dim = x.shape
    heads = attn.num_heads

    def split(t: Tensor) -> Tensor:
        return t.view(batch, n, heads, dim // heads).transpose(1, 2)

    return split(x @ w_q.T + b_q), split(x @ w_k.T + b_k)


def encoder_batch(batch_first: bool) -> tuple[Tensor, Tensor]:
    src = torch.randn(3, 10, models.HIDDEN, generator=torch.Generator().manual_seed(11))
    pad = torch.zeros(3, 10, dtype=torch.bool)  # MHA convention: True = padding
    pad[1, 7:] = True
    pad[2, 4:] = True
    return (src if batch_first else src.transpose(0, 1).contiguous()), pad


def encoder_reference(encoder: nn.TransformerEncoder, src: Tensor, pad: Tensor, batch_first: bool) -> list[Tensor]:
    real = ~pad
    visible = real[:, None, None, :]
    expected = []
    with torch.no_grad():
        x = src
        for layer in encoder.layers:
            q, k = mha_qk(layer.self_attn, x, batch_first)
            expected.append(reference_means(probs_from_qk(q, k, visible), visible, real))
            x = layer(x, src_key_padding_mask=pad)
    return expected


ENCODER_LAYERS = ["layers.0.self_attn", "layers.1.self_attn"]


@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
def test_transformer_encoder_matches_reference(batch_first: bool, mode: str) -> None:
    encoder = models.transformer_encoder(batch_first).train(mode == "train")
    src, pad = encoder_batch(batch_first)
    expected = encoder_reference(encoder, src, pad, batch_first)
    if mode == "eval":
        summary = evaluate_attention(
            encoder,
            [(src, pad)],
            forward=lambda model, batch: model(batch[0], src_key_padding_mask=batch[1]),
            padding_mask=lambda batch: ~batch[1],
        )
    else:
        with AttentionCapture(encoder) as capture, capture.recording(~pad):
            encoder(src, src_key_padding_mask=pad).sum().backward()
        summary = capture.metric.compute()
    assert_summary(summary, ENCODER_LAYERS, expected)
    assert encoder.training is (mode == "train")


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
def test_transformer_encoder_outputs(batch_first: bool) -> None:
    """Train mode: bit-identical. Eval + no_grad: close only, on real positions.

    In eval + no_grad PyTorch runs its native fast path (and, with
    ``enable_nested_tensor``, a NestedTensor whose padding positions come back
    as 0). While recording, the capture's TorchFunctionMode makes
    ``has_torch_function`` true, so the same batch runs the Python slow path:
    the same math with a different kernel, equal to ~1e-6, and padding
    positions hold real values instead of 0. So only real positions are
    compared, with ``allclose(atol=1e-5)``.
    """
    encoder = models.transformer_encoder(batch_first, dropout=0.1)
    src, pad = encoder_batch(batch_first)
    real = ~pad if batch_first else (~pad).T

    encoder.train()

    def run() -> Tensor:
        torch.manual_seed(5)
        return encoder(src, src_key_padding_mask=pad)

    plain = run()
    with AttentionCapture(encoder) as capture, capture.recording(~pad):
        recorded = run()
    assert capture.num_calls == models.LAYERS
    assert torch.equal(plain, recorded)

    encoder.eval()
    with torch.no_grad():
        plain = encoder(src, src_key_padding_mask=pad)
        with AttentionCapture(encoder) as capture, capture.recording(~pad):
            recorded = encoder(src, src_key_padding_mask=pad)
    assert capture.num_calls == models.LAYERS
    torch.testing.assert_close(recorded[real], plain[real], atol=1e-5, rtol=0)


def mha_masks(
    kind: str, padding: str, n: int, batch: int
) -> tuple[Tensor | None, Tensor | None, Tensor, Tensor | None]:
    """(attn_mask, key_padding_mask) in MHA's convention, and the true support and additive bias."""
    generator = torch.Generator().manual_seed(13)
    hidden = torch.rand(n, n, generator=generator) < 0.4
    hidden.fill_diagonal_(False)  # every query keeps a key
    pad = torch.zeros(batch, n, dtype=torch.bool)
    pad[1, 6:] = True
    visible = torch.ones(1, 1, n, n, dtype=torch.bool)
    bias = None
    attn_mask: Tensor | None = None
    if kind == "bool":
        attn_mask = hidden
    elif kind == "float":
        attn_mask = torch.zeros(n, n).masked_fill(hidden, -math.inf)
    elif kind == "float_bias":
        attn_mask = torch.randn(n, n, generator=generator).masked_fill(hidden, -math.inf)
        bias = attn_mask[None, None]
    elif kind == "bool_per_head":
        per_head = torch.rand(batch * models.HEADS, n, n, generator=generator) < 0.4
        per_head[:, torch.arange(n), torch.arange(n)] = False
        attn_mask = per_head
        visible = ~per_head.view(batch, models.HEADS, n, n)
    if kind in ("bool", "float", "float_bias"):
        visible = ~hidden[None, None]
    key_padding_mask: Tensor | None = None
    if padding != "none":
        visible = visible & ~pad[:, None, None, :]
        is_bool = kind in ("none", "bool", "bool_per_head")
        key_padding_mask = pad if is_bool else torch.zeros(batch, n).masked_fill(pad, -math.inf)
    return attn_mask, key_padding_mask, visible, bias


@pytest.mark.parametrize("padding", ["none", "key_padding"])
@pytest.mark.parametrize("kind", ["none", "bool", "float", "float_bias", "bool_per_head"])
def test_multihead_attention_masks(kind: str, padding: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("attn", nn.MultiheadAttention(models.HIDDEN, models.HEADS, batch_first=True))
    attn = model.attn
    models.sharpen(attn.in_proj_weight)
    x = torch.randn(2, 9, models.HIDDEN, generator=torch.Generator().manual_seed(3))
    attn_mask, kpm, visible, bias = mha_masks(kind, padding, 9, 2)
    real = (
        torch.ones(2, 9, dtype=torch.bool)
        if padding == "none"
        else torch.tensor([[True] * 9, [True] * 6 + [False] * 3])
    )
    with torch.no_grad():
        q, k = mha_qk(attn, x, batch_first=True)
        expected = [reference_means(probs_from_qk(q, k, visible, bias), visible, real)]

    def forward(module: nn.Module, batch: Tensor) -> Tensor:
        return module.attn(batch, batch, batch, attn_mask=attn_mask, key_padding_mask=kpm, need_weights=False)[0]

    summary = evaluate_attention(model, [x], forward=forward, padding_mask=lambda _: real)
    assert_summary(summary, ["attn"], expected)

    # The same with need_weights=True (averaged weights), in train mode with gradients.
    model.train()
    with AttentionCapture(model) as capture, capture.recording(real):
        attn(x, x, x, attn_mask=attn_mask, key_padding_mask=kpm)[0].sum().backward()
    assert_summary(capture.metric.compute(), ["attn"], expected)


def test_multihead_attention_as_the_model() -> None:
    """A bare nn.MultiheadAttention passed as the model (its qualified name is the empty string)."""
    torch.manual_seed(0)
    attn = nn.MultiheadAttention(models.HIDDEN, models.HEADS, batch_first=True).eval()
    models.sharpen(attn.in_proj_weight)
    x = torch.randn(2, 7, models.HIDDEN, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        q, k = mha_qk(attn, x, batch_first=True)
    visible = torch.ones(1, 1, 7, 7, dtype=torch.bool)
    expected = reference_means(probs_from_qk(q, k, visible), visible, torch.ones(2, 7, dtype=torch.bool))
    summary = evaluate_attention(attn, [x], forward=lambda m, b: m(b, b, b, need_weights=False))
    assert len(summary.layers) == 1 and summary.layers[0]
    torch.testing.assert_close(summary.mean[0], expected, atol=TOL, rtol=0)


# --------------------------------------------------------------------------- hooks and lifecycle


def hook_models() -> dict[str, Callable[[], tuple[nn.Module, Callable[[nn.Module], Tensor]]]]:
    batch = hf_batch("right")

    def hf(family: str, implementation: str):
        return lambda: (models.hf_model(family, implementation), lambda m: m(**batch)[0])

    return {
        "nanogpt": lambda: (models.NanoGPT().eval(), lambda m: m(tokens())),
        "gpt2-sdpa": hf("gpt2", "sdpa"),
        "gpt2-eager": hf("gpt2", "eager"),
        "bert-sdpa": hf("bert", "sdpa"),
        "llama-eager": hf("llama", "eager"),
    }


HOOK_MODELS = hook_models()


@pytest.mark.parametrize("name", list(HOOK_MODELS))
def test_hooks_removed_after_normal_exit(name: str) -> None:
    model, run = HOOK_MODELS[name]()
    before = total_hooks(model)
    capture = AttentionCapture(model)
    assert capture.num_hooks == 0 and not capture.attached
    with capture:
        assert capture.num_hooks > 0 and capture.attached
        assert total_hooks(model) == before + capture.num_hooks
        capture.attach()  # idempotent
        assert total_hooks(model) == before + capture.num_hooks
        with capture.recording(), torch.no_grad():
            run(model)
        assert total_hooks(model) == before + capture.num_hooks
    assert capture.num_hooks == 0 and not capture.attached
    assert total_hooks(model) == before
    capture.detach()
    capture.detach()
    assert total_hooks(model) == before
    assert capture.num_calls == models.LAYERS


def test_hooks_removed_after_exception_inside_forward() -> None:
    model = models.NanoGPT().eval()
    idx = tokens()
    before = total_hooks(model)
    model.blocks[1].attn.fail_after_sdpa = True
    with AttentionCapture(model) as capture:
        with pytest.raises(RuntimeError, match="on purpose"), capture.recording():
            model(idx)
        # Still attached, not recording, with no stale owner on the stack: a later recording is clean.
        assert total_hooks(model) == before + capture.num_hooks
        model.blocks[1].attn.fail_after_sdpa = False
        capture.metric.reset()
        with capture.recording(), torch.no_grad():
            model(idx)
        assert_summary(capture.metric.compute(), NANOGPT_LAYERS, nanogpt_reference(model, idx))
    assert total_hooks(model) == before


def test_hooks_removed_after_exception_in_evaluate_attention() -> None:
    model = models.hf_model("gpt2", "sdpa").train()
    before = total_hooks(model)

    def forward(module: nn.Module, batch: dict) -> None:
        module(**batch)
        raise KeyError("forward_fn failed")

    with pytest.raises(KeyError, match="forward_fn failed"):
        evaluate_attention(model, [hf_batch("right")], forward=forward)
    assert total_hooks(model) == before
    assert model.training
    assert model.config._attn_implementation == "sdpa"


def test_exception_with_body_outside_recording() -> None:
    model = models.hf_model("bert", "eager")
    before = total_hooks(model)
    with pytest.raises(ValueError, match="body"), AttentionCapture(model):
        raise ValueError("body")
    assert total_hooks(model) == before


def test_nested_captures_clean_up_independently() -> None:
    model = models.NanoGPT().eval()
    idx = tokens()
    expected = nanogpt_reference(model, idx)
    before = total_hooks(model)
    with AttentionCapture(model) as outer:
        after_outer = total_hooks(model)
        with AttentionCapture(model) as inner:
            assert total_hooks(model) == after_outer + inner.num_hooks
            with outer.recording(), inner.recording(), torch.no_grad():
                model(idx)
        assert inner.num_hooks == 0
        assert total_hooks(model) == after_outer
        # A second capture after the first is gone, then the outer alone again.
        with AttentionCapture(model) as second, second.recording(), torch.no_grad():
            model(idx)
        assert total_hooks(model) == after_outer
        with outer.recording(), torch.no_grad():
            model(idx)
    assert total_hooks(model) == before
    assert_summary(inner.metric.compute(), NANOGPT_LAYERS, expected)
    assert_summary(second.metric.compute(), NANOGPT_LAYERS, expected)
    assert_summary(outer.metric.compute(), NANOGPT_LAYERS, expected)
    assert int(outer.metric.compute().count.sum()) == 2 * int(inner.metric.compute().count.sum())


def _refuse(call, sample) -> None:
    raise ValueError("measuring refused")


@pytest.mark.parametrize(
    ("name", "layer", "module_class"),
    [
        ("gpt2-eager", "transformer.h.0.attn", "module class GPT2Attention"),
        ("gpt2-sdpa", "transformer.h.0.attn", "module class GPT2Attention"),
        ("nanogpt", "blocks.0.attn", "module class CausalSelfAttention"),
    ],
)
def test_offline_errors_name_the_layer_and_its_class(name: str, layer: str, module_class: str) -> None:
    """``errors="raise"``: an error of a reader or consumer keeps its type and names the layer and its class.

    Without the naming (the error re-raised as it came) the match fails.
    """
    model, run = HOOK_MODELS[name]()
    capture = AttentionCapture(model)
    named = rf"could not record a call of '{layer}' \({module_class}\): measuring refused.*layers="
    with capture, torch.no_grad(), pytest.raises(ValueError, match=named), capture.recording(consumers=[_refuse]):
        run(model)


def test_recording_misuse() -> None:
    model = models.NanoGPT().eval()
    capture = AttentionCapture(model)
    with pytest.raises(RuntimeError, match=r"[Aa]ttach"), capture.recording():
        pass
    with capture:
        with capture.recording(), pytest.raises(RuntimeError, match="nest"), capture.recording():
            pass
        # The failed nested attempt did not end the outer recording's clean-up state.
        with capture.recording(), torch.no_grad():
            model(tokens())
    assert total_hooks(model) == 0
    assert capture.num_calls == models.LAYERS


def test_nonfinite_softmax_logits_are_counted_not_raised() -> None:
    """A NaN logit (a diverging model) leaves its query out, counted as non-finite; ``-inf`` only hides a key.

    Without the logits branch of ``without_nonfinite`` the update raises on the NaN.
    """
    from attn_monitor.capture.consumers import EntropyUpdate, StatisticsUpdate
    from attn_monitor.capture.softmax import logits_call
    from attn_monitor.metrics.entropy import AttentionEntropy
    from tests.helpers import reference

    logits = 3.0 * torch.randn(1, 2, 3, 4, generator=torch.Generator().manual_seed(0))
    logits[0, 0, 0, 3] = -math.inf
    logits[0, 1, 2, 1] = math.nan
    call = dataclasses.replace(logits_call(logits, logits.softmax(-1)), layer="eager")
    metric, statistics = AttentionEntropy(), StatisticsUpdate(distance=False)
    sample = torch.ones(1, 1, 3, dtype=torch.bool)
    with pytest.warns(UserWarning, match="NaN or inf"):
        EntropyUpdate(metric)(call, sample)
    statistics(call, sample)
    summary = metric.compute()
    assert summary.nonfinite.tolist() == [[0.0, 1.0]]
    assert summary.count.tolist() == [[3.0, 2.0]]
    visible = logits > -math.inf
    entropy = reference.entropy_from_scores(logits.nan_to_num(0.0).double(), visible)
    normalised = reference.normalize(entropy, reference.num_valid(visible))
    expected = [float(normalised[0, 0].mean()), float(normalised[0, 1, :2].mean())]
    assert summary.mean[0].tolist() == pytest.approx(expected, abs=1e-6)
    largest = statistics.metric.compute().max_logit[0]
    want = [float(logits[0, 0].masked_fill(~visible[0, 0], -math.inf).max()), float(logits[0, 1, :2].max())]
    assert largest.tolist() == pytest.approx(want, abs=1e-6)


@pytest.mark.parametrize("name", ["nanogpt", "gpt2-eager", "mha"])
def test_no_reference_to_captured_tensors_survives(name: str) -> None:
    if name == "mha":
        model = nn.TransformerEncoderLayer(models.HIDDEN, models.HEADS, 2 * models.HIDDEN, batch_first=True)

        def run(m: nn.Module) -> Tensor:
            return m(torch.randn(2, 6, models.HIDDEN))
    else:
        model, run = HOOK_MODELS[name]()
    refs: list[weakref.ref] = []

    def keep_weakrefs(call, sample) -> None:
        # Every tensor the call carries (q, k, probs, masks, ...), its support's masks, and the sample mask.
        values = [getattr(call, f.name) for f in dataclasses.fields(call)]
        values += [call.support.mask, call.support.padding_mask, sample]
        refs.extend(weakref.ref(value) for value in values if isinstance(value, Tensor))

    with AttentionCapture(model) as capture:
        capture.consumers.append(keep_weakrefs)
        for _ in range(2):
            with capture.recording(), torch.no_grad():
                out = run(model)
            del out
            gc.collect()
            assert refs
            assert [r for r in refs if r() is not None] == []
    assert capture.num_calls > 0


def test_model_without_attention() -> None:
    mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    with pytest.raises(RuntimeError, match="scaled_dot_product_attention") as info:
        evaluate_attention(mlp, [torch.randn(2, 8)])
    message = str(info.value)
    assert "adapter" in message and "attn_implementation" in message
    assert total_hooks(mlp) == 0


# --------------------------------------------------------------------------- torch.compile


class CountingBackend:
    """``backend="aot_eager"`` that counts the graphs it is given."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        from torch._dynamo.backends.registry import lookup_backend

        self.graphs += 1
        return lookup_backend("aot_eager")(gm, example_inputs)


def test_torch_compile_aot_eager_backend() -> None:
    """Capture attached before compiling; one recording through the compiled model matches eager.

    Each SDPA call must reach the consumers once, under its owner's name.
    ``aot_eager`` lowers the graph as inductor does (``backend="eager"``
    replays torch-level calls, which the capture would see a second time).
    """
    torch._dynamo.reset()
    model = models.NanoGPT().eval()
    idx = tokens()
    expected = nanogpt_reference(model, idx)
    start = time.monotonic()
    try:
        with AttentionCapture(model) as capture:
            compiled = torch.compile(model, backend="aot_eager")
            layers: list[str] = []
            capture.consumers.append(lambda call, sample: layers.append(call.layer))
            with torch.no_grad():
                plain = compiled(idx)
                with capture.recording():
                    recorded = compiled(idx)
            assert torch.equal(plain, recorded)
            assert torch.equal(plain, model(idx))
            assert layers == NANOGPT_LAYERS
            assert_summary(capture.metric.compute(), NANOGPT_LAYERS, expected)
    finally:
        torch._dynamo.reset()
    if time.monotonic() - start > 60:
        pytest.skip("torch.compile took over 60 s here; results were checked, but the test is too slow")


def test_torch_compile_one_graph_per_state() -> None:
    """Repeated recordings reuse the compiled "recording" graph (docs/design.md §6: one recompile per on/off state).

    A recompile per recording costs seconds per batch and, past dynamo's
    recompile limit (8), silently drops the model back to eager execution.
    """
    torch._dynamo.reset()
    model = models.NanoGPT().eval()
    idx = tokens()
    backend = CountingBackend()
    try:
        with AttentionCapture(model) as capture:
            compiled = torch.compile(model, backend=backend)
            with torch.no_grad():
                compiled(idx)
                for _ in range(3):
                    with capture.recording():
                        compiled(idx)
                compiled(idx)
    finally:
        torch._dynamo.reset()
    assert backend.graphs <= 2, f"{backend.graphs} graphs compiled for 2 states (off, recording)"


@pytest.mark.parametrize("hidden_is_true", [True, False], ids=["true_hides", "true_shows"])
def test_auto_bool_reading_of_a_mask_that_hides_nothing(hidden_is_true: bool) -> None:
    """A batch with nothing masked: all False under "True = hidden" must not read as "no key visible"."""

    class Eager(torch.nn.Module):
        def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
            return x

    probs = torch.softmax(torch.randn(2, 3, 5, 5, generator=torch.Generator().manual_seed(0)), -1)
    mask = torch.full((2, 1, 5, 5), not hidden_is_true)
    call = probabilities_at(1, bool_mask="auto")(Eager(), (None,), {"attention_mask": mask}, (None, probs))
    assert call is not None
    assert torch.equal(call.support.num_valid().expand(2, 3, 5), torch.full((2, 3, 5), 5))
