"""Encoder-decoders and other Hugging Face families against an independent float64 reference.

Every query is counted by the sequence it comes from: the encoder's
``attention_mask`` for encoder self-attention, the decoder's
``decoder_attention_mask`` for decoder self- and cross-attention, never the
other way round, whatever the lengths. The reference never imports
attn_monitor: an eager twin of each model (same weights) is run with
``output_attentions=True``, and its documented weights are pooled over the
support the model's documented masks imply:

* encoder self-attention: keys where ``attention_mask`` is 1; queries are the
  encoder's real tokens;
* decoder self-attention: keys ``j <= i`` where ``decoder_attention_mask`` is
  1; queries are the decoder's real tokens;
* cross-attention: keys where ``attention_mask`` is 1; queries are the
  decoder's real tokens;
* decoder-only models (Bloom, MPT): causal, keys where ``attention_mask`` is 1.

Whisper's encoder takes no mask (every audio frame is real). Bloom and MPT
have eager attention only (probabilities, MPT with a bool mask that is True
where a key is hidden); T5 returns ``(output, position_bias, weights)`` and
takes its mask as ``mask=``.

Families whose eager modules apply masks the ``attention_mask=`` argument does
not show, read from the logits of their own softmax:

* GPT-Neo: layer 0 global (causal), layer 1 local: keys ``i - W < j <= i``
  (its window from the module's ``bias`` buffer), both with key padding;
* DeBERTa-v2: keys where ``attention_mask`` is 1, from a (B, 1, N, N) 0/1
  int64 mask; its modules return no weights without ``output_attentions``;
* Swin: every key of the query's window is visible (the shifted blocks'
  -100 is a finite bias, not a mask), every query is counted, in batches of
  (batch x windows).
"""

from __future__ import annotations

import functools
import math
import warnings
import zlib

import pytest
import torch
from torch import Tensor, nn

from attn_monitor.capture.consumers import StatisticsUpdate
from attn_monitor.capture.eager import probabilities_at
from attn_monitor.capture.evaluate import evaluate_attention
from attn_monitor.capture.hooks import AttentionCapture
from tests.helpers import models, reference

pytest.importorskip("transformers")

TOL = 1e-4
#: Heads of a layer must differ at least this much in the reference, else a test proves little.
SPREAD = 0.02
BATCH = 3
SEQ2SEQ = ("bart", "t5", "whisper")
DECODER_ONLY = ("bloom", "mpt")
#: Families read from the input of their own softmax.
SOFTMAX_FAMILIES = ("gpt_neo", "deberta_v2", "swin")
#: (source length, target length).
LENGTHS = {"equal": (10, 10), "unequal": (10, 7)}
#: Real tokens per row: the encoder and the decoder are padded differently on purpose.
SOURCE_REAL = (1.0, 0.7, 0.4)
TARGET_REAL = (0.5, 1.0, 0.75)


def layer_names(family: str) -> dict[str, list[str]]:
    """Qualified names of the attention layers, by kind ("encoder", "decoder", "cross" / "self")."""
    layers = range(models.LAYERS)
    if family in ("bart", "whisper"):
        return {
            "encoder": [f"model.encoder.layers.{i}.self_attn" for i in layers],
            "decoder": [f"model.decoder.layers.{i}.self_attn" for i in layers],
            "cross": [f"model.decoder.layers.{i}.encoder_attn" for i in layers],
        }
    if family == "t5":
        return {
            "encoder": [f"encoder.block.{i}.layer.0.SelfAttention" for i in layers],
            "decoder": [f"decoder.block.{i}.layer.0.SelfAttention" for i in layers],
            "cross": [f"decoder.block.{i}.layer.1.EncDecAttention" for i in layers],
        }
    if family == "bloom":
        return {"self": [f"transformer.h.{i}.self_attention" for i in layers]}
    if family == "gpt_neo":
        return {"self": [f"transformer.h.{i}.attn.attention" for i in layers]}
    if family == "deberta_v2":
        return {"self": [f"encoder.layer.{i}.attention.self" for i in layers]}
    if family == "swin":
        return {"self": [f"encoder.layers.{s}.blocks.{b}.attention" for s in layers for b in range(2)]}
    return {"self": [f"transformer.blocks.{i}.attn" for i in layers]}


@functools.cache
def model_of(family: str, implementation: str) -> nn.Module:
    """One tiny model per (family, implementation) for the whole module: every twin has the same weights."""
    return models.zoo_model(family, implementation)


def padding(fractions: tuple[float, ...], length: int, side: str) -> Tensor:
    """(B, length) long mask with ``round(f * length)`` real tokens per row, on the ``side`` given."""
    mask = torch.zeros(len(fractions), length, dtype=torch.long)
    for row, fraction in enumerate(fractions):
        real = max(1, round(fraction * length))
        if side == "right":
            mask[row, :real] = 1
        else:
            mask[row, length - real :] = 1
    return mask


def seq2seq_batch(family: str, lengths: str, side: str, padded: str) -> dict[str, Tensor]:
    """A batch with source padding (``padded`` "source" or "both") and target padding ("both")."""
    source, target = LENGTHS[lengths]
    generator = torch.Generator().manual_seed(zlib.crc32(f"{family}-{lengths}-{side}-{padded}".encode()))
    batch: dict[str, Tensor] = {
        "decoder_input_ids": torch.randint(3, models.VOCAB, (BATCH, target), generator=generator),
    }
    if family == "whisper":
        # Two feature frames per encoder position (the stride-2 convolution); the encoder has no mask.
        batch["input_features"] = torch.randn(BATCH, models.WHISPER_MEL_BINS, 2 * source, generator=generator)
    else:
        batch["input_ids"] = torch.randint(3, models.VOCAB, (BATCH, source), generator=generator)
        batch["attention_mask"] = padding(SOURCE_REAL, source, side)
    if padded == "both":
        batch["decoder_attention_mask"] = padding(TARGET_REAL, target, side)
    return batch


def seq2seq_reference(family: str, batch: dict[str, Tensor]) -> dict[str, tuple[Tensor, Tensor]]:
    """layer name -> ((H,) mean, (H,) count) from the eager twin's documented weights and masks."""
    twin = model_of(family, "eager")
    with torch.no_grad():
        out = twin(**batch, output_attentions=True)
    target = batch["decoder_input_ids"].shape[1]
    source_length = out.encoder_last_hidden_state.shape[1]
    source = batch.get("attention_mask", torch.ones(BATCH, source_length, dtype=torch.long)).bool()
    decoder = batch.get("decoder_attention_mask", torch.ones(BATCH, target, dtype=torch.long)).bool()
    causal = torch.ones(target, target, dtype=torch.bool).tril()
    names = layer_names(family)
    expected = {}
    for kind, attentions, visible, real in (
        ("encoder", out.encoder_attentions, source[:, None, None, :], source),
        ("decoder", out.decoder_attentions, causal & decoder[:, None, None, :], decoder),
        ("cross", out.cross_attentions, source[:, None, None, :], decoder),
    ):
        assert len(attentions) == models.LAYERS
        for name, probs in zip(names[kind], attentions, strict=True):
            expected[name] = reference.head_means(probs, visible, real)
    return expected


def decoder_only_batch(family: str, side: str) -> dict[str, Tensor]:
    generator = torch.Generator().manual_seed(zlib.crc32(f"{family}-{side}".encode()))
    return {
        "input_ids": torch.randint(3, models.VOCAB, (BATCH, 10), generator=generator),
        "attention_mask": padding(SOURCE_REAL, 10, side),
    }


def decoder_only_reference(family: str, batch: dict[str, Tensor]) -> dict[str, tuple[Tensor, Tensor]]:
    with torch.no_grad():
        attentions = model_of(family, "eager")(**batch, output_attentions=True).attentions
    real = batch["attention_mask"].bool()
    visible = torch.ones(real.shape[1], real.shape[1], dtype=torch.bool).tril() & real[:, None, None, :]
    return {
        name: reference.head_means(probs, visible, real)
        for name, probs in zip(layer_names(family)["self"], attentions, strict=True)
    }


def assert_matches(summary, expected: dict[str, tuple[Tensor, Tensor]]) -> None:
    """Same layers; per layer and head the reference is spread, the means agree and the counts are equal."""
    assert sorted(summary.layers) == sorted(expected)
    for name, (mean, count) in expected.items():
        assert float(mean.max() - mean.min()) > SPREAD, f"reference heads of {name} barely differ: {mean.tolist()}"
        index = summary.layer_index(name)
        heads = mean.shape[0]
        assert summary.count[index, :heads].tolist() == count.tolist(), f"counts of {name}"
        torch.testing.assert_close(summary.mean[index, :heads], mean, atol=TOL, rtol=0, msg=f"means of {name}")


# --------------------------------------------------------------------------- encoder-decoders


@pytest.mark.parametrize("padded", ["both", "source"], ids=["source+target-padding", "source-padding"])
@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("lengths", list(LENGTHS))
@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("family", SEQ2SEQ)
def test_seq2seq_matches_reference(family: str, implementation: str, lengths: str, side: str, padded: str) -> None:
    batch = seq2seq_batch(family, lengths, side, padded)
    expected = seq2seq_reference(family, batch)
    summary = evaluate_attention(model_of(family, implementation), [batch])
    assert_matches(summary, expected)


@pytest.mark.parametrize("family", SEQ2SEQ)
def test_seq2seq_layer_pattern_masks(family: str) -> None:
    """A ``padding_mask`` callable returning {layer pattern: mask} gives each sequence its own mask."""
    batch = seq2seq_batch(family, "equal", "right", "both")
    expected = seq2seq_reference(family, batch)
    names = layer_names(family)
    decoder_scope = names["decoder"][0].split(".layers.")[0].split(".block.")[0]

    def masks(batch: dict[str, Tensor]) -> dict[str, Tensor]:
        given = {f"{decoder_scope}.*": batch["decoder_attention_mask"]}
        if "attention_mask" in batch:
            given["*encoder*"] = batch["attention_mask"]
        return given

    model = model_of(family, "sdpa")
    forward_batch = {key: value for key, value in batch.items()}
    summary = evaluate_attention(model, [forward_batch], padding_mask=masks)
    assert_matches(summary, expected)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("family", SEQ2SEQ)
def test_self_and_cross_attention_are_separate_layers(family: str, implementation: str) -> None:
    batch = seq2seq_batch(family, "equal", "right", "both")
    summary = evaluate_attention(model_of(family, implementation), [batch])
    names = layer_names(family)
    expected = [*names["encoder"]]
    for self_attn, cross_attn in zip(names["decoder"], names["cross"], strict=True):
        expected += [self_attn, cross_attn]
    assert summary.layers == expected
    assert not set(names["decoder"]) & set(names["cross"])


# --------------------------------------------------------------------------- decoder-only, eager only


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("family", DECODER_ONLY)
def test_decoder_only_eager_matches_reference(family: str, side: str) -> None:
    model = model_of(family, "eager")
    attention = model.get_submodule(layer_names(family)["self"][0])
    assert getattr(attention, "config", None) is None  # found through the model's config
    batch = decoder_only_batch(family, side)
    summary = evaluate_attention(model, [batch])
    assert_matches(summary, decoder_only_reference(family, batch))


def test_mpt_bool_mask_polarity_given_explicitly() -> None:
    """MPT's bool mask is True where a key is hidden: an explicit adapter says so, "auto" finds it."""
    model = model_of("mpt", "eager")
    batch = decoder_only_batch("mpt", "left")
    expected = decoder_only_reference("mpt", batch)
    hidden = {"transformer.blocks.*.attn": probabilities_at(1, bool_mask="hidden")}
    assert_matches(evaluate_attention(model, [batch], adapters=hidden), expected)
    with pytest.raises(ValueError, match="bool_mask"):
        probabilities_at(1, bool_mask="true_is_hidden")


# --------------------------------------------------------------------------- no padding mask given


@pytest.mark.parametrize(
    ("family", "implementation"),
    [("bart", "sdpa"), ("t5", "eager"), ("bloom", "eager"), ("mpt", "eager")],
)
def test_without_padding_mask_self_attention_counts_its_own_tokens(family: str, implementation: str) -> None:
    """No mask from the batch: a self-attention call's real queries are the keys its own mask shows real.

    Only the source is padded, so cross-attention (no mask of its own queries) counts every decoder
    query, as the reference does. Right padding: causal padding queries still see real keys.
    """
    if family in DECODER_ONLY:
        batch = decoder_only_batch(family, "right")
        expected = decoder_only_reference(family, batch)
    else:
        batch = seq2seq_batch(family, "equal", "left", "source")
        expected = seq2seq_reference(family, batch)
    summary = evaluate_attention(model_of(family, implementation), [batch], padding_mask=lambda batch: None)
    assert_matches(summary, expected)


# --------------------------------------------------------------------------- what cannot be read


class UnreadableAttention(nn.Module):
    """Looks like Hugging Face eager attention, but returns ``(output, logits)``: no probabilities."""

    def __init__(self) -> None:
        super().__init__()
        self.qk = nn.Linear(8, 16)

    def forward(self, hidden_states: Tensor, attention_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        q, k = self.qk(hidden_states).view(*hidden_states.shape[:2], 2, 2, 4).unbind(2)
        logits = torch.einsum("bqhd,bkhd->bhqk", q, k) - 5.0
        return hidden_states, logits


class UnreadableModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = type("Config", (), {"_attn_implementation": "eager"})()
        self.blocks = nn.ModuleList([UnreadableAttention()])

    def forward(self, x: Tensor) -> Tensor:
        return self.blocks[0](x)[0]


def test_unreadable_eager_attention_warns_and_names_the_module() -> None:
    torch.manual_seed(0)
    model = UnreadableModel()
    unreadable = r"'blocks\.0'.*UnreadableAttention.*adapters="
    with pytest.warns(UserWarning, match=unreadable), pytest.raises(RuntimeError, match="captured no attention"):
        evaluate_attention(model, [torch.randn(2, 5, 8)])


class WrittenOutAttention(nn.Module):
    """Hugging Face style eager attention written out by hand, each way a module can hide its weights.

    ``weights``: "returned" (its softmax's output), "head_mask" (that output halved before it is
    returned), "none" (returns None), "twice" (a second softmax over ten times the first one's output, returned).
    ``softmax``: False computes the weights with ``exp`` and a sum, so no softmax can be seen.
    """

    def __init__(self, weights: str, softmax: bool = True) -> None:
        super().__init__()
        self.weights, self.softmax = weights, softmax
        self.qk = nn.Linear(8, 16)
        with torch.no_grad():
            self.qk.weight *= 2.0  # far from uniform,
            self.qk.weight[:4] *= 3.0  # and head 0 (its queries: rows 0-3) far sharper than head 1

    def logits(self, hidden_states: Tensor) -> Tensor:
        q, k = self.qk(hidden_states).view(*hidden_states.shape[:2], 2, 2, 4).unbind(2)
        return torch.einsum("bqhd,bkhd->bhqk", q, k)

    def forward(self, hidden_states: Tensor, attention_mask: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        logits = self.logits(hidden_states)
        probs = torch.softmax(logits, dim=-1) if self.softmax else logits.exp() / logits.exp().sum(-1, keepdim=True)
        if self.weights == "twice":
            probs = (10 * probs).softmax(-1)
        returned = {"returned": probs, "head_mask": 0.5 * probs, "none": None, "twice": probs}[self.weights]
        return hidden_states + probs.sum(), returned


class WrittenOutModel(nn.Module):
    def __init__(self, weights: str, softmax: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.config = type("Config", (), {"_attn_implementation": "eager"})()
        self.blocks = nn.ModuleList([WrittenOutAttention(weights, softmax)])

    def forward(self, x: Tensor) -> Tensor:
        return self.blocks[0](x)[0]


def written_out_reference(model: WrittenOutModel, x: Tensor, twice: bool = False) -> dict[str, tuple[Tensor, Tensor]]:
    """Every key visible, every query counted: the float64 softmax of float64 logits (twice, if asked)."""
    attention = model.blocks[0].requires_grad_(False)
    hidden = x.double()
    q, k = (hidden @ attention.qk.weight.double().T + attention.qk.bias.double()).view(*x.shape[:2], 2, 2, 4).unbind(2)
    probs = torch.einsum("bqhd,bkhd->bhqk", q, k).softmax(-1)
    if twice:
        probs = (10 * probs).softmax(-1)
    everything = torch.ones(x.shape[0], x.shape[1], dtype=torch.bool)
    return {"blocks.0": reference.head_means(probs, everything[:, None, None, :], everything)}


def test_weights_that_differ_from_the_softmax_warn_and_the_softmax_is_measured() -> None:
    """A module that changes its weights after the softmax (a head mask) is named; its logits are measured."""
    model, x = WrittenOutModel("head_mask"), torch.randn(2, 6, 8)
    expected = written_out_reference(model, x)
    differs = r"'blocks\.0' \(WrittenOutAttention\) returned attention weights at output\[1\] that differ"
    with pytest.warns(UserWarning, match=differs):
        summary = evaluate_attention(model, [x])
    assert_matches(summary, expected)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # weights as the softmax made them: nothing to say
        assert_matches(evaluate_attention(WrittenOutModel("returned"), [x]), expected)


def test_several_softmaxes_keep_the_probabilities_reader() -> None:
    """Two softmaxes inside one module cannot be told apart: the returned weights are read, as before."""
    model, x = WrittenOutModel("twice"), torch.randn(2, 6, 8)
    assert_matches(evaluate_attention(model, [x]), written_out_reference(model, x, twice=True))


def test_no_weights_and_no_softmax_warns_naming_the_module() -> None:
    """Returned weights are None and no softmax ran: the module, its class and what to pass are named."""
    model = WrittenOutModel("none", softmax=False)
    unread = r"'blocks\.0' \(WrittenOutAttention\).*output\[1\] holds no probabilities.*output_attentions=True"
    with pytest.warns(UserWarning, match=unread), pytest.raises(RuntimeError, match="captured no attention"):
        evaluate_attention(model, [torch.randn(2, 5, 8)])
    # With a softmax the same module is read, weights or not.
    x = torch.randn(2, 6, 8)
    model = WrittenOutModel("none")
    assert_matches(evaluate_attention(model, [x]), written_out_reference(model, x))


def test_padding_mask_of_another_sequence_warns() -> None:
    """A mask whose length is not the layer's query count is not used for it, and says so."""
    model = model_of("bloom", "eager")
    batch = decoder_only_batch("bloom", "right")
    other = torch.ones(BATCH, 7, dtype=torch.bool)
    warning = r"padding mask for 'transformer\.h\.\d\.self_attention'"
    capture = AttentionCapture(model)
    with capture, torch.no_grad(), pytest.warns(UserWarning, match=warning) as caught, capture.recording(other):
        model(**batch)
    assert capture.num_calls == models.LAYERS
    assert len(caught) == models.LAYERS  # once per layer


def test_recording_rejects_bad_padding_masks() -> None:
    model = model_of("bloom", "eager")
    with AttentionCapture(model) as capture:
        with pytest.raises(ValueError, match=r"padding_mask\['\*'\]"), capture.recording({"*": torch.ones(3)}):
            pass
        with pytest.raises(TypeError, match="layer patterns"), capture.recording({0: torch.ones(3, 4)}):  # type: ignore[dict-item]
            pass


# --------------------------------------------------------------------------- nn.Transformer


def test_torch_transformer_decoder_counts_its_own_queries() -> None:
    """``nn.Transformer``, equal lengths: the source's mask stays out of the decoder; a mapping reaches it.

    The reference reads each attention module's documented weights (``need_weights=True``, per head)
    on the inputs a plain forward gives it.
    """
    torch.manual_seed(0)
    model = nn.Transformer(
        d_model=32, nhead=4, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=64, dropout=0.0
    )
    model.batch_first = True
    for module in model.modules():
        if isinstance(module, nn.MultiheadAttention):
            module.batch_first = True
            with torch.no_grad():
                module.in_proj_weight[:64] *= 4.0  # sharper attention: heads differ
    model.eval()
    n = 10
    source, target = padding(SOURCE_REAL, n, "right").bool(), padding(TARGET_REAL, n, "right").bool()
    src, tgt = torch.randn(BATCH, n, 32), torch.randn(BATCH, n, 32)
    causal = nn.Transformer.generate_square_subsequent_mask(n)
    kwargs = {
        "tgt_mask": causal,
        "src_key_padding_mask": ~source,
        "tgt_key_padding_mask": ~target,
        "memory_key_padding_mask": ~source,
    }
    inputs: dict[str, tuple] = {}
    handles = [
        module.register_forward_pre_hook(
            lambda m, args, kw, name=name: inputs.__setitem__(name, (args, kw)), with_kwargs=True
        )
        for name, module in model.named_modules()
        if isinstance(module, nn.MultiheadAttention)
    ]
    model(src, tgt, **kwargs)  # gradients on: the encoder's fast path stays off, every module runs
    for handle in handles:
        handle.remove()
    decoder_visible = torch.ones(n, n, dtype=torch.bool).tril() & target[:, None, None, :]
    truth = {
        "encoder.layers.0.self_attn": (source[:, None, None, :], source),
        "decoder.layers.0.self_attn": (decoder_visible, target),
        "decoder.layers.0.multihead_attn": (source[:, None, None, :], target),
    }
    expected = {}
    with torch.no_grad():
        for name, (visible, real) in truth.items():
            args, kw = inputs[name]
            kw = {**kw, "need_weights": True, "average_attn_weights": False}
            weights = model.get_submodule(name)(*args, **kw)[1]
            expected[name] = reference.head_means(weights, visible, real)

    def run(masks: Tensor | dict[str, Tensor]):
        return evaluate_attention(
            model, [(src, tgt)], forward=lambda m, b: m(*b, **kwargs), padding_mask=lambda b: masks
        )

    assert_matches(run({"decoder.*": target, "*": source}), expected)
    # The source's mask alone: decoder self-attention counts its own real tokens (its key padding);
    # cross-attention, with no word on its queries, counts every one that sees a key.
    summary = run(source)
    cross = summary.layer_index("decoder.layers.0.multihead_attn")
    assert summary.count[cross].tolist() == [BATCH * n] * 4
    del expected["decoder.layers.0.multihead_attn"]
    for name, (mean, count) in expected.items():
        index = summary.layer_index(name)
        assert summary.count[index].tolist() == count.tolist(), name
        torch.testing.assert_close(summary.mean[index], mean, atol=TOL, rtol=0, msg=name)


# --------------------------------------------------------------------------- read from the softmax's logits


def gpt_neo_visible(real: Tensor, layer: int) -> Tensor:
    """(B, 1, N, N) support of GPT-Neo's layer ``layer``: causal, windowed in the local layers, key padding."""
    n = real.shape[1]
    rows, cols = torch.arange(n)[:, None], torch.arange(n)[None, :]
    visible = cols <= rows
    if layer % 2 == 1:  # attention_types: global, local, global, ...
        visible = visible & (cols > rows - models.GPT_NEO_WINDOW)
    return visible & real[:, None, None, :]


def softmax_family_batch(family: str, side: str) -> dict[str, Tensor]:
    generator = torch.Generator().manual_seed(zlib.crc32(f"{family}-{side}".encode()))
    if family == "swin":
        image = models.SWIN_SIZES[0]
        return {"pixel_values": torch.randn(BATCH, 3, image, image, generator=generator)}
    return decoder_only_batch(family, side)


def softmax_family_reference(family: str, batch: dict[str, Tensor]) -> dict[str, tuple[Tensor, Tensor]]:
    """layer -> ((H,) mean, (H,) count) from each attention module's own returned weights, supports by hand."""
    model = model_of(family, "eager")
    names = layer_names(family)["self"]
    weights: dict[str, Tensor] = {}
    handles = [
        model.get_submodule(name).register_forward_hook(
            lambda module, args, output, name=name: weights.__setitem__(name, output[1])
        )
        for name in names
    ]
    try:
        with torch.no_grad():
            model(**batch, output_attentions=True)
    finally:
        for handle in handles:
            handle.remove()
    expected = {}
    for layer, name in enumerate(names):
        probs = weights[name]
        if family == "swin":  # (batch x windows, heads, N, N): every key visible, every query counted
            visible = torch.ones(1, 1, 1, probs.shape[-1], dtype=torch.bool)
            real = torch.ones(probs.shape[0], probs.shape[-2], dtype=torch.bool)
        else:
            real = batch["attention_mask"].bool()
            visible = gpt_neo_visible(real, layer) if family == "gpt_neo" else real[:, None, None, :]
        expected[name] = reference.head_means(probs, visible, real)
    return expected


@pytest.mark.parametrize(
    ("family", "side"),
    [
        (family, side)
        for family in SOFTMAX_FAMILIES
        for side in ("right", "left")
        if family != "swin" or side == "right"
    ],
)
def test_masks_inside_the_module_match_reference(family: str, side: str) -> None:
    """GPT-Neo's windows, DeBERTa-v2's (B, 1, N, N) int mask, Swin's shifted windows: read from the softmax.

    Reading the returned weights with the ``attention_mask=`` argument instead fails each of them:
    GPT-Neo's local layer is normalised over every causal key (0.08 off), DeBERTa-v2 returns no
    weights, Swin's window-batched mask does not broadcast.
    """
    batch = softmax_family_batch(family, side)
    expected = softmax_family_reference(family, batch)
    model = model_of(family, "eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the returned weights agree with the softmax: no warning
        summary = evaluate_attention(model, [batch])
    assert_matches(summary, expected)


def test_deberta_v2_with_output_attentions_matches_reference() -> None:
    """Asked for its weights, DeBERTa-v2 returns them next to a (B, 1, N, N) int64 mask: the same numbers."""
    batch = softmax_family_batch("deberta_v2", "left")
    expected = softmax_family_reference("deberta_v2", batch)
    summary = evaluate_attention(model_of("deberta_v2", "eager"), [{**batch, "output_attentions": True}])
    assert_matches(summary, expected)


def test_swin_shifted_windows_carry_a_finite_bias() -> None:
    """The Swin reference means something: one block of the first stage is shifted, its mask a finite
    -100 between regions of a window (visible keys with a bias), and attention runs on (batch x windows)."""
    model = model_of("swin", "eager")
    image, patch, window = models.SWIN_SIZES
    side = image // patch
    plain, shifted = (model.get_submodule(name.rsplit(".", 1)[0]) for name in layer_names("swin")["self"][:2])
    assert plain.get_attn_mask(side, side, torch.float32, torch.device("cpu")) is None
    mask = shifted.get_attn_mask(side, side, torch.float32, torch.device("cpu"))
    assert mask.shape == ((side // window) ** 2, window**2, window**2)
    assert set(mask.unique().tolist()) == {-100.0, 0.0}
    expected = softmax_family_reference("swin", softmax_family_batch("swin", "right"))
    first = expected[layer_names("swin")["self"][0]][1]
    assert first.tolist() == [BATCH * side**2] * first.shape[0]  # every patch of every image, once per head


@pytest.mark.parametrize("side", ["right", "left"])
def test_gpt_neo_max_logit_matches_float64_reference(side: str) -> None:
    """Eager layers report max logit: GPT-Neo's (unscaled ``q k^T``) from float64 q and k, windows included."""
    model = model_of("gpt_neo", "eager")
    batch = softmax_family_batch("gpt_neo", side)
    names = layer_names("gpt_neo")["self"]
    inputs: dict[str, Tensor] = {}
    handles = [
        model.get_submodule(name).register_forward_pre_hook(
            lambda module, args, name=name: inputs.__setitem__(name, args[0])
        )
        for name in names
    ]
    update = StatisticsUpdate(distance=False)
    capture = AttentionCapture(model)
    try:
        with capture, torch.no_grad(), capture.recording(batch["attention_mask"], consumers=[update]):
            model(**batch)
    finally:
        for handle in handles:
            handle.remove()
    summary = update.metric.compute()
    real = batch["attention_mask"].bool()
    for layer, name in enumerate(names):
        module = model.get_submodule(name)
        hidden = inputs[name].double()

        def heads(weight: Tensor, hidden: Tensor = hidden) -> Tensor:
            return (
                (hidden @ weight.double().T)
                .view(BATCH, -1, models.ZOO_HEADS, models.ZOO_HIDDEN // models.ZOO_HEADS)
                .transpose(1, 2)
            )

        visible = gpt_neo_visible(real, layer)
        per_query = reference.max_logit_from_qk(heads(module.q_proj.weight), heads(module.k_proj.weight), visible, 1.0)
        counted = real[:, None, :] & visible.any(-1)
        expected = torch.where(counted, per_query, -math.inf).amax((0, 2))
        assert float(expected.max() - expected.min()) > 1.0, f"reference heads of {name} barely differ"
        index = summary.layers.index(name)
        torch.testing.assert_close(summary.max_logit[index], expected, atol=1e-4, rtol=1e-6, msg=name)
        assert summary.logit_count[index].tolist() == counted.expand(-1, models.ZOO_HEADS, -1).sum((0, 2)).tolist()
