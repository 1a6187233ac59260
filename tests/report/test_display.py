"""Display names of layers: the part that sets a model's layers apart, unique and never empty.

Name sets are those the monitor finds in Hugging Face models (GPT-2, Llama,
BERT, T5 with encoder self-, decoder self- and cross-attention). Broken
variants caught (each tried, then restored): no limit on what is dropped
(the nested-name case empties a name); a single name shortened to its last
component; duplicates let through.
"""

from __future__ import annotations

import pytest

from attn_monitor.report.display import short_names


def gpt2(layers: int) -> list[str]:
    return [f"model.transformer.h.{i}.attn" for i in range(layers)]


T5 = [
    *(f"model.encoder.block.{i}.layer.0.SelfAttention" for i in range(2)),
    *(f"model.decoder.block.{i}.layer.0.SelfAttention" for i in range(2)),
    *(f"model.decoder.block.{i}.layer.1.EncDecAttention" for i in range(2)),
]


@pytest.mark.parametrize(
    ("names", "want"),
    [
        (gpt2(12), [str(i) for i in range(12)]),
        ([f"model.model.layers.{i}.self_attn" for i in range(3)], ["0", "1", "2"]),  # Llama
        ([f"bert.encoder.layer.{i}.attention.self" for i in range(2)], ["0", "1"]),  # BERT
        (
            T5,
            [
                "encoder.block.0.layer.0.SelfAttention",
                "encoder.block.1.layer.0.SelfAttention",
                "decoder.block.0.layer.0.SelfAttention",
                "decoder.block.1.layer.0.SelfAttention",
                "decoder.block.0.layer.1.EncDecAttention",
                "decoder.block.1.layer.1.EncDecAttention",
            ],
        ),
        (  # BART-like: self and cross attention of the decoder only
            ["model.decoder.layers.0.self_attn", "model.decoder.layers.0.encoder_attn"],
            ["self_attn", "encoder_attn"],
        ),
        (["h.0.attn", "h.0.attn.inner"], ["attn", "attn.inner"]),  # one name inside the other
        (["blocks.0.attn"], ["blocks.0.attn"]),  # a single layer keeps its name
        (["a", "b"], ["a", "b"]),
        ([], []),
    ],
    ids=["gpt2", "llama", "bert", "t5", "bart-decoder", "nested", "single", "undotted", "empty"],
)
def test_short_names(names: list[str], want: list[str]) -> None:
    got = short_names(names)
    assert got == want
    assert all(got) and len(set(got)) == len(got)
    for full, short in zip(names, got, strict=True):
        assert short in full


def test_thirty_two_layers_keep_two_digit_names() -> None:
    assert short_names(gpt2(32))[-1] == "31"


def test_a_repeated_name_is_refused() -> None:
    with pytest.raises(ValueError, match=r"\['h.0'\] more than once"):
        short_names(["h.0", "h.1", "h.0"])
