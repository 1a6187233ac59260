"""Tiny models for capture tests: Hugging Face families from random configs, and hand-written ones.

Nothing here imports attn_monitor, and nothing is downloaded: every Hugging
Face model is built from a small config with random weights. Sizes: hidden 32,
2 layers, 4 heads (head_dim 8), vocabulary 64.

The hand-written models expose their pieces so that tests can recompute q and
k from the weights for an independent reference:

* :class:`NanoGPT`: ``F.scaled_dot_product_attention(q, k, v, is_causal=True)``.
* :class:`PackedLM`: several documents packed into one row, attending through
  a bool ``attn_mask`` built from document ids (block diagonal, optionally
  causal inside each block).
* :class:`EagerLM`: attention written out by hand; the attention module
  returns ``(out, probs)`` and takes ``attention_mask=`` as a keyword, the way
  Hugging Face eager attention does, for adapter tests.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

HIDDEN = 32
LAYERS = 2
HEADS = 4
HEAD_DIM = HIDDEN // HEADS
VOCAB = 64
MAX_LEN = 32
#: Larger than Hugging Face's 0.02 so attention is far from uniform: entropies spread
#: out and a query counted wrongly moves the mean well past the test tolerance.
INIT_RANGE = 0.3
#: Same idea for the hand-written models: q and k projections scaled up from PyTorch's default init.
SHARPEN = 4.0

__all__ = [
    "GPT_NEO_WINDOW",
    "HEADS",
    "HIDDEN",
    "LAYERS",
    "SWIN_SIZES",
    "VOCAB",
    "WHISPER_MEL_BINS",
    "WHISPER_SOURCE",
    "ZOO_HEADS",
    "ZOO_HIDDEN",
    "EagerLM",
    "NanoGPT",
    "PackedLM",
    "hf_model",
    "sharpen",
    "transformer_encoder",
    "zoo_model",
]


def sharpen(weight: Tensor, dim: int = HIDDEN, factor: float = SHARPEN) -> None:
    """Scale the q and k rows (the first ``2 * dim``) of a packed q/k/v projection weight in place."""
    with torch.no_grad():
        weight[: 2 * dim] *= factor


# --------------------------------------------------------------------------- Hugging Face


def _hf_config(family: str, dropout: float, attention_dropout: float) -> tuple[type, object]:
    """(model class, config) of a tiny random model of ``family``."""
    import transformers

    if family == "gpt2":
        config = transformers.GPT2Config(
            n_embd=HIDDEN,
            n_layer=LAYERS,
            n_head=HEADS,
            n_inner=2 * HIDDEN,
            vocab_size=VOCAB,
            n_positions=MAX_LEN,
            attn_pdrop=attention_dropout,
            resid_pdrop=dropout,
            embd_pdrop=dropout,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=0,
            initializer_range=INIT_RANGE,
        )
        return transformers.GPT2LMHeadModel, config
    if family == "llama":
        config = transformers.LlamaConfig(
            hidden_size=HIDDEN,
            intermediate_size=2 * HIDDEN,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            num_key_value_heads=HEADS // 2,  # grouped-query attention
            vocab_size=VOCAB,
            max_position_embeddings=MAX_LEN,
            attention_dropout=attention_dropout,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=0,
            initializer_range=INIT_RANGE,
        )
        return transformers.LlamaForCausalLM, config
    if family == "bert":
        config = transformers.BertConfig(
            hidden_size=HIDDEN,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            intermediate_size=2 * HIDDEN,
            vocab_size=VOCAB,
            max_position_embeddings=MAX_LEN,
            attention_probs_dropout_prob=attention_dropout,
            hidden_dropout_prob=dropout,
            pad_token_id=0,
            initializer_range=INIT_RANGE,
        )
        return transformers.BertModel, config
    raise ValueError(f"Unknown family {family!r}.")


def hf_model(
    family: str,
    implementation: str,
    *,
    dropout: float = 0.0,
    attention_dropout: float | None = None,
    seed: int = 0,
) -> nn.Module:
    """A tiny random ``family`` model ("gpt2", "llama", "bert") running ``implementation``, in eval mode.

    ``dropout`` applies everywhere the family has dropout; ``attention_dropout``
    (default: ``dropout``) to the attention probabilities only.

    The config is deep-copied for every model: ``_from_config`` reuses the
    config object, so two models built from one config would share (and flip)
    one ``_attn_implementation``.
    """
    attention_dropout = dropout if attention_dropout is None else attention_dropout
    cls, config = _hf_config(family, dropout, attention_dropout)
    torch.manual_seed(seed)
    model = cls._from_config(copy.deepcopy(config), attn_implementation=implementation)
    return model.eval()


# --------------------------------------------------------------------------- nanoGPT


class MLP(nn.Module):
    def __init__(self, dim: int = HIDDEN) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, 2 * dim)
        self.proj = nn.Linear(2 * dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.gelu(self.fc(x)))


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention: one fused q/k/v projection, SDPA with ``is_causal=True``.

    ``fail_after_sdpa`` makes forward raise right after its SDPA call (tests of
    clean-up when a forward fails halfway through an attention module).
    """

    def __init__(self, dim: int = HIDDEN, heads: int = HEADS, dropout: float = 0.0) -> None:
        super().__init__()
        self.heads = heads
        self.dropout = dropout
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)
        sharpen(self.c_attn.weight, dim)
        self.fail_after_sdpa = False

    def qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(B, T, C) -> q, k, v of shape (B, heads, T, head_dim)."""
        batch, length, dim = x.shape
        q, k, v = self.c_attn(x).split(dim, dim=2)
        return tuple(t.view(batch, length, self.heads, dim // self.heads).transpose(1, 2) for t in (q, k, v))

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.qkv(x)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        if self.fail_after_sdpa:
            raise RuntimeError("forward failed on purpose")
        return self.c_proj(y.transpose(1, 2).reshape(x.shape))


class Block(nn.Module):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(HIDDEN)
        self.attn = CausalSelfAttention(dropout=dropout)
        self.ln_2 = nn.LayerNorm(HIDDEN)
        self.mlp = MLP()
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.drop(self.attn(self.ln_1(x)))
        return x + self.drop(self.mlp(self.ln_2(x)))


class NanoGPT(nn.Module):
    """Token + position embeddings, pre-norm blocks, tied-free LM head."""

    def __init__(self, dropout: float = 0.0, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.wte = nn.Embedding(VOCAB, HIDDEN)
        self.wpe = nn.Embedding(MAX_LEN, HIDDEN)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(dropout) for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def embed(self, idx: Tensor) -> Tensor:
        return self.drop(self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device)))

    def forward(self, idx: Tensor) -> Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


# --------------------------------------------------------------------------- packed documents


def document_mask(document_ids: Tensor, causal: bool) -> Tensor:
    """(B, N) ids -> (B, 1, N, N) bool mask, True = visible: same document (and j <= i if causal)."""
    visible = document_ids[:, None, :, None] == document_ids[:, None, None, :]
    if causal:
        n = document_ids.shape[1]
        visible = visible & torch.ones(n, n, dtype=torch.bool, device=document_ids.device).tril()
    return visible


class DocumentAttention(CausalSelfAttention):
    def forward(self, x: Tensor, attn_mask: Tensor) -> Tensor:  # type: ignore[override]
        q, k, v = self.qkv(x)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return self.c_proj(y.transpose(1, 2).reshape(x.shape))


class PackedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(HIDDEN)
        self.attn = DocumentAttention()
        self.ln_2 = nn.LayerNorm(HIDDEN)
        self.mlp = MLP()

    def forward(self, x: Tensor, attn_mask: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x), attn_mask)
        return x + self.mlp(self.ln_2(x))


class PackedLM(nn.Module):
    """Packed sequences: ``forward(idx, document_ids)``, block-diagonal bool mask built from the ids."""

    def __init__(self, causal: bool = True, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.causal = causal
        self.wte = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(PackedBlock() for _ in range(LAYERS))

    def forward(self, idx: Tensor, document_ids: Tensor) -> Tensor:
        mask = document_mask(document_ids, self.causal)
        x = self.wte(idx)
        for block in self.blocks:
            x = block(x, mask)
        return x


# --------------------------------------------------------------------------- eager attention with (out, probs)


class Mixer(nn.Module):
    """Eager attention returning ``(out, probs)``; ``attention_mask`` is bool, True = visible.

    The class name deliberately says nothing about attention: an adapter has
    to point capture at it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.heads = HEADS
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        sharpen(self.qkv.weight)

    def forward(self, x: Tensor, attention_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        batch, length, dim = x.shape
        q, k, v = (
            t.view(batch, length, self.heads, dim // self.heads).transpose(1, 2) for t in self.qkv(x).split(dim, dim=2)
        )
        scores = q @ k.transpose(-1, -2) / math.sqrt(dim // self.heads)
        if attention_mask is not None:
            scores = scores.masked_fill(~attention_mask, float("-inf"))
        probs = scores.softmax(-1)
        out = (probs @ v).transpose(1, 2).reshape(batch, length, dim)
        return self.proj(out), probs


class EagerBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(HIDDEN)
        self.mixer = Mixer()

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        out, _ = self.mixer(self.ln(x), attention_mask=mask)
        return x + out


class EagerLM(nn.Module):
    """``forward(idx, padding)``: padding (B, N) bool, True = real token; causal, key padding hidden."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.wte = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(EagerBlock() for _ in range(LAYERS))

    @staticmethod
    def mask(padding: Tensor) -> Tensor:
        n = padding.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool, device=padding.device).tril()
        # The diagonal stays visible so padding rows are never empty (no NaN in probs).
        return (causal & padding[:, None, None, :]) | torch.eye(n, dtype=torch.bool, device=padding.device)

    def forward(self, idx: Tensor, padding: Tensor) -> Tensor:
        mask = self.mask(padding)
        x = self.wte(idx)
        for block in self.blocks:
            x = block(x, mask)
        return x


# --------------------------------------------------------------------------- nn.TransformerEncoder


def transformer_encoder(batch_first: bool, *, dropout: float = 0.0, seed: int = 0) -> nn.TransformerEncoder:
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(
        HIDDEN, HEADS, dim_feedforward=2 * HIDDEN, dropout=dropout, batch_first=batch_first
    )
    encoder = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=batch_first)
    for each in encoder.layers:
        sharpen(each.self_attn.in_proj_weight)
    return encoder


# --------------------------------------------------------------------------- the wider Hugging Face zoo

#: Encoder-decoder and decoder-only families with their own attention code (eager probabilities at
#: other output positions, masks under other names and polarities). Sizes: hidden 16, 2 layers, 4 heads.
ZOO_HIDDEN, ZOO_HEADS = 32, 4
#: Far larger than Hugging Face's defaults (tiny random models otherwise attend almost uniformly), and
#: not so large that every head turns one-hot: heads must differ for a reference to prove anything.
ZOO_INIT = {
    "bart": 0.7,
    "t5": 1.5,
    "whisper": 0.7,
    "bloom": 1.0,
    "mpt": 0.7,
    "gpt_neo": 0.3,
    "deberta_v2": 0.3,
    "swin": 0.3,
}
#: GPT-Neo's local layers see this many most recent keys (its ``window_size``); layer 0 is global, 1 local.
GPT_NEO_WINDOW = 4
#: Swin: (image size, patch size, window size); 16 x 16 patches in windows of 4 x 4, shifted every other block.
SWIN_SIZES = (32, 2, 4)


def _zoo_config(family: str) -> tuple[type, object]:
    import transformers

    common = {"vocab_size": VOCAB, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    if family == "bart":
        config = transformers.BartConfig(
            d_model=ZOO_HIDDEN,
            encoder_layers=LAYERS,
            decoder_layers=LAYERS,
            encoder_attention_heads=ZOO_HEADS,
            decoder_attention_heads=ZOO_HEADS,
            encoder_ffn_dim=2 * ZOO_HIDDEN,
            decoder_ffn_dim=2 * ZOO_HIDDEN,
            max_position_embeddings=MAX_LEN,
            init_std=ZOO_INIT[family],
            decoder_start_token_id=1,
            **common,
        )
        return transformers.BartForConditionalGeneration, config
    if family == "t5":
        config = transformers.T5Config(
            d_model=ZOO_HIDDEN,
            d_kv=ZOO_HIDDEN // ZOO_HEADS,
            d_ff=2 * ZOO_HIDDEN,
            num_layers=LAYERS,
            num_decoder_layers=LAYERS,
            num_heads=ZOO_HEADS,
            relative_attention_num_buckets=8,
            initializer_factor=ZOO_INIT[family],
            decoder_start_token_id=1,
            **common,
        )
        return transformers.T5ForConditionalGeneration, config
    if family == "whisper":
        config = transformers.WhisperConfig(
            d_model=ZOO_HIDDEN,
            encoder_layers=LAYERS,
            decoder_layers=LAYERS,
            encoder_attention_heads=ZOO_HEADS,
            decoder_attention_heads=ZOO_HEADS,
            encoder_ffn_dim=2 * ZOO_HIDDEN,
            decoder_ffn_dim=2 * ZOO_HIDDEN,
            num_mel_bins=WHISPER_MEL_BINS,
            max_source_positions=WHISPER_SOURCE,
            max_target_positions=MAX_LEN,
            init_std=ZOO_INIT[family],
            decoder_start_token_id=1,
            **common,
        )
        return transformers.WhisperForConditionalGeneration, config
    if family == "bloom":
        config = transformers.BloomConfig(
            hidden_size=ZOO_HIDDEN, n_layer=LAYERS, n_head=ZOO_HEADS, initializer_range=ZOO_INIT[family], **common
        )
        return transformers.BloomForCausalLM, config
    if family == "mpt":
        config = transformers.MptConfig(
            d_model=ZOO_HIDDEN,
            n_layers=LAYERS,
            n_heads=ZOO_HEADS,
            max_seq_len=MAX_LEN,
            initializer_range=ZOO_INIT[family],
            **common,
        )
        return transformers.MptForCausalLM, config
    if family == "gpt_neo":
        config = transformers.GPTNeoConfig(
            hidden_size=ZOO_HIDDEN,
            num_layers=LAYERS,
            attention_types=[[["global", "local"], LAYERS // 2]],
            num_heads=ZOO_HEADS,
            intermediate_size=2 * ZOO_HIDDEN,
            window_size=GPT_NEO_WINDOW,
            max_position_embeddings=MAX_LEN,
            initializer_range=ZOO_INIT[family],
            **common,
        )
        return transformers.GPTNeoForCausalLM, config
    if family == "deberta_v2":
        config = transformers.DebertaV2Config(
            hidden_size=ZOO_HIDDEN,
            num_hidden_layers=LAYERS,
            num_attention_heads=ZOO_HEADS,
            intermediate_size=2 * ZOO_HIDDEN,
            max_position_embeddings=MAX_LEN,
            relative_attention=True,
            pos_att_type=["p2c", "c2p"],
            position_buckets=8,
            initializer_range=ZOO_INIT[family],
            **common,
        )
        return transformers.DebertaV2Model, config
    if family == "swin":
        image, patch, window = SWIN_SIZES
        config = transformers.SwinConfig(
            image_size=image,
            patch_size=patch,
            embed_dim=32,
            depths=[2, 2],
            num_heads=[4, 4],
            window_size=window,
            initializer_range=ZOO_INIT[family],
        )
        return transformers.SwinModel, config
    raise ValueError(f"Unknown family {family!r}.")


#: Mel bins of the tiny Whisper: its encoder takes (batch, bins, 2 * source length) features.
WHISPER_MEL_BINS = 8
#: Encoder positions of the tiny Whisper (it takes exactly twice as many feature frames).
WHISPER_SOURCE = 10


def zoo_model(family: str, implementation: str, *, seed: int = 0) -> nn.Module:
    """A tiny random ``family`` model in eval mode: "bart", "t5", "whisper", "bloom", "mpt", "gpt_neo",
    "deberta_v2", "swin".

    Bloom, MPT and DeBERTa-v2 have eager attention only; GPT-Neo eager (or flash). The config is deep-copied
    (see :func:`hf_model`).
    """
    cls, config = _zoo_config(family)
    torch.manual_seed(seed)
    return cls._from_config(copy.deepcopy(config), attn_implementation=implementation).eval()
