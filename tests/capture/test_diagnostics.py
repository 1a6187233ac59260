"""Mass diagnostics (docs/design.md §2): attention-sink mass, KV-eviction coverage, cross-document leakage.

Every number is checked against an independent float64 dense reference
written here (nothing from attn_monitor in it): the support each query may
see is built cell by cell from the model's own masking rules, the attention
distribution is an explicit softmax over that support, from q and k that the
test models (or a forward pre-hook recomputing Hugging Face projections and
rotary embeddings) hand over, and each diagnostic is a plain sum of
probabilities over an explicit key set:

* sink mass: keys among the first ``s`` *real* tokens of the query's own
  sequence (with left padding the sequence starts at its first real token),
  or of the query's own document in packed batches (another document's
  leading tokens are not this query's sinks, even where the mask leaks);
* coverage of a policy ``(s, w)``: keys that are sinks OR in the causal window
  ``i - w < j <= i``;
* leakage: keys of another document than the query's.

Counted queries are real tokens with at least one visible key. Per (key, head)
token-weighted means must agree to 1e-5 and histogram quantiles must lie
within one bin (0.001) of the exact order statistics.

Paths covered: SDPA q/k (fused logsumexp and ``method="chunked"``), modules
returning probabilities (an adapter on a hand-written eager module, Hugging
Face eager Llama with left padding), ``evaluate_attention`` with a Hugging
Face sdpa Llama, and :class:`AttentionEntropyMonitor` in real ``Trainer.fit``
runs (CSV and in-memory loggers; collapse alerts; saved summaries).
"""

from __future__ import annotations

import csv
import math
import os
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from torch import Tensor, nn

from attn_monitor import (
    AttentionCall,
    AttentionCapture,
    AttentionEntropyMonitor,
    AttentionMass,
    Batches,
    CollapseAlert,
    LogOptions,
    MassDiagnostics,
    MassSummary,
    Statistics,
    Support,
    evaluate_attention,
    load_summary,
    probabilities_at,
)
from attn_monitor.functional.masks import leading_keys
from tests.helpers import lightning_models as lm
from tests.helpers import models

MEAN_TOL = 1e-5
BIN = 1e-3  # AttentionMass's default bin width
QUANTILE_TOL = BIN + 1e-5
SEQ = 16
HEADS = models.HEADS
HIDDEN = models.HIDDEN
HEAD_DIM = HIDDEN // HEADS
LAYERS = 2

#: Rows of a packed batch: (left padding, document lengths, right padding); each row is SEQ long.
PACKED = [(0, [5, 7, 4], 0), (0, [6, 6], 4), (3, [3, 10], 0)]
#: Rows of a plain left-padded batch: one document per row.
LEFT_PADDED = [(3, [13], 0), (0, [16], 0), (6, [10], 0)]
#: Packed rows with short documents, so sink counts exceed some documents.
SHORT_DOCS = [(1, [2, 1, 5, 4], 3), (0, [1, 1, 1, 13], 0)]


# =========================================================================== reference (no attn_monitor)


def make_batch(layout: Sequence[tuple[int, list[int], int]], seed: int) -> dict[str, Tensor]:
    """A dict batch from a layout: random ids, 0/1 ``attention_mask``, contiguous ``document_ids``.

    Left padding gets document id -1, right padding the id after the last document.
    """
    generator = torch.Generator().manual_seed(seed)
    masks, documents = [], []
    for left, lengths, right in layout:
        assert left + sum(lengths) + right == SEQ
        masks.append([0] * left + [1] * sum(lengths) + [0] * right)
        ids = [-1] * left
        for doc, length in enumerate(lengths):
            ids += [doc] * length
        documents.append(ids + [len(lengths)] * right)
    attention_mask = torch.tensor(masks)
    input_ids = torch.randint(1, models.VOCAB, (len(layout), SEQ), generator=generator)
    return {
        "input_ids": input_ids.masked_fill(attention_mask == 0, 0),
        "attention_mask": attention_mask,
        "document_ids": torch.tensor(documents),
    }


def ref_leading(count: int, padding: list[list[int]] | None, documents: list[list[int]] | None, length: int):
    """(B, length) lists of bools: the first ``count`` real tokens of each row, or of each document."""
    rows = len(padding) if padding is not None else (len(documents) if documents is not None else 1)
    out = []
    for b in range(rows):
        row, previous, seen = [], object(), 0
        for j in range(length):
            doc = documents[b][j] if documents is not None else 0
            if doc != previous:
                previous, seen = doc, 0
            real = bool(padding[b][j]) if padding is not None else True
            if real:
                seen += 1
            row.append(real and seen <= count)
        out.append(row)
    return out


def ref_dense(
    batch: int,
    num_queries: int,
    num_keys: int,
    *,
    heads: int = 1,
    padding: list[list[int]] | None = None,
    keys: list[list[bool]] | None = None,
    causal: bool = False,
    window: int | None = None,
    documents: list[list[int]] | None = None,
    explicit: Tensor | None = None,
) -> Tensor:
    """(B, heads, Nq, Nk) bool, cell by cell: the intersection of every given rule."""
    rule = None if explicit is None else explicit.expand(batch, heads, num_queries, num_keys).tolist()
    out = torch.zeros(batch, heads, num_queries, num_keys, dtype=torch.bool)
    for b in range(batch):
        for h in range(heads):
            for i in range(num_queries):
                for j in range(num_keys):
                    ok = True
                    if padding is not None:
                        ok = ok and bool(padding[b if len(padding) > 1 else 0][j])
                    if keys is not None:
                        ok = ok and bool(keys[b if len(keys) > 1 else 0][j])
                    if causal:
                        ok = ok and j <= i
                    if window is not None:
                        ok = ok and i - window < j <= i
                    if documents is not None:
                        ok = ok and documents[b][i] == documents[b][j]
                    if rule is not None:
                        ok = ok and bool(rule[b][h][i][j])
                    out[b, h, i, j] = ok
    return out


def ref_probs(q: Tensor, k: Tensor, scale: float, visible: Tensor, bias: Tensor | None = None) -> Tensor:
    """Explicit float64 softmax of ``scale q k^T (+ bias)`` over ``visible`` (B, 1 or H, N, N); empty rows are 0."""
    q, k = q.double(), k.double()
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    logits = scale * q @ k.transpose(-1, -2)
    if bias is not None:
        logits = logits + bias.double()
    logits = logits.masked_fill(~visible, -math.inf)
    top = logits.amax(-1, keepdim=True)
    weights = (logits - torch.where(torch.isfinite(top), top, torch.zeros_like(top))).exp()
    weights = torch.where(visible, weights, torch.zeros_like(weights))
    total = weights.sum(-1, keepdim=True)
    return weights / torch.where(total > 0, total, torch.ones_like(total))


def ref_masses(
    probs: Tensor,
    visible: Tensor,
    batch: dict[str, Tensor],
    *,
    sink_tokens: int | None,
    policies: Sequence[tuple[int, int]] = (),
    leakage: bool = False,
    use_documents: bool = True,
) -> dict[str, Tensor]:
    """Diagnostic name -> (H, queries) float64 masses of the counted queries, in (row, position) order."""
    b_size, heads, length, _ = probs.shape
    padding = batch["attention_mask"].tolist()
    documents = batch["document_ids"].tolist() if use_documents else None
    visible = visible.expand(b_size, heads, length, length)
    key_sets: dict[str, list[list[list[bool]]]] = {}  # name -> [b][i][j]

    def own_sink(leading: list[list[bool]], b: int, i: int, j: int) -> bool:
        return leading[b][j] and (documents is None or documents[b][j] == documents[b][i])

    if sink_tokens is not None:
        sinks = ref_leading(sink_tokens, padding, documents, length)
        key_sets["sink_mass"] = [
            [[own_sink(sinks, b, i, j) for j in range(length)] for i in range(length)] for b in range(b_size)
        ]
    for count, window in policies:
        sinks = ref_leading(count, padding, documents, length) if count else [[False] * length] * b_size
        key_sets[f"coverage_s{count}_w{window}"] = [
            [[own_sink(sinks, b, i, j) or i - window < j <= i for j in range(length)] for i in range(length)]
            for b in range(b_size)
        ]
    if leakage and documents is not None:
        key_sets["leakage"] = [
            [[documents[b][i] != documents[b][j] for j in range(length)] for i in range(length)] for b in range(b_size)
        ]
    out: dict[str, list[list[float]]] = {name: [[] for _ in range(heads)] for name in key_sets}
    for b in range(b_size):
        for i in range(length):
            if not padding[b][i] or not visible[b, 0, i].any():
                continue
            for name, sets in key_sets.items():
                chosen = torch.tensor(sets[b][i])
                for h in range(heads):
                    out[name][h].append(float(probs[b, h, i][chosen].sum()))
    return {name: torch.tensor(values, dtype=torch.float64) for name, values in out.items()}


def merge(parts: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Concatenate per-batch references along the query axis."""
    return {name: torch.cat([part[name] for part in parts], dim=1) for name in parts[0]}


def order_bounds(values: Tensor, q: float) -> tuple[float, float]:
    ordered = values.sort().values
    position = q * (len(ordered) - 1)
    return float(ordered[math.floor(position)]), float(ordered[math.ceil(position)])


def check_summary(summary: MassSummary, reference: dict[str, Tensor]) -> None:
    """Per (key, head): counts equal, means to 1e-5, quantiles within one bin of the order statistics."""
    assert sorted(summary.layers) == sorted(reference), (summary.layers, sorted(reference))
    problems = []
    medians = {q: summary.quantile(q) for q in (0.05, 0.5, 0.95)}
    for key, values in reference.items():
        index = summary.layers.index(key)
        heads = values.shape[0]
        assert summary.num_heads[index] == heads
        assert summary.count[index, :heads].tolist() == [float(values.shape[1])] * heads, key
        for h in range(heads):
            got, want = float(summary.mean[index, h]), float(values[h].mean())
            if abs(got - want) > MEAN_TOL:
                problems.append(f"{key} head {h}: mean {got!r}, reference {want!r}")
            for q, quantiles in medians.items():
                low, high = order_bounds(values[h], q)
                got = float(quantiles[index, h])
                if not low - QUANTILE_TOL <= got <= high + QUANTILE_TOL:
                    problems.append(f"{key} head {h}: q{q} {got!r}, exact in [{low!r}, {high!r}]")
        pooled = float(summary.layer_mean[index])
        if abs(pooled - float(values.mean())) > MEAN_TOL:
            problems.append(f"{key}: layer mean {pooled!r}, reference {float(values.mean())!r}")
    assert not problems, "\n".join(problems)


# =========================================================================== test models


class MaskedAttention(nn.Module):
    """nanoGPT attention through SDPA with an explicit bool mask; keeps its last q and k for the reference."""

    def __init__(self) -> None:
        super().__init__()
        self.c_attn = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.c_proj = nn.Linear(HIDDEN, HIDDEN)
        self.temperature: float | None = None  # logit scale factor; None: SDPA's default scale
        self.last: tuple[Tensor, Tensor] | None = None

    @property
    def scale(self) -> float:
        return (1.0 if self.temperature is None else self.temperature) / math.sqrt(HEAD_DIM)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        batch, length, dim = x.shape
        q, k, v = (t.view(batch, length, HEADS, HEAD_DIM).transpose(1, 2) for t in self.c_attn(x).split(dim, dim=2))
        self.last = (q.detach().clone(), k.detach().clone())
        scale = None if self.temperature is None else self.scale
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        return self.c_proj(y.transpose(1, 2).reshape(x.shape))


class MaskedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(HIDDEN)
        self.attn = MaskedAttention()
        self.ln_2 = nn.LayerNorm(HIDDEN)
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(), nn.Linear(2 * HIDDEN, HIDDEN))

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x), mask)
        return x + self.mlp(self.ln_2(x))


class PackedGPT(nn.Module):
    """Causal LM over (possibly packed, padded) rows.

    Mask: causal AND key padding, AND same document when ``isolate`` (a
    block-diagonal packing mask); the diagonal is always visible so padding
    rows are never empty.
    """

    def __init__(self, isolate: bool, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.isolate = isolate
        self.wte = nn.Embedding(models.VOCAB, HIDDEN)
        self.wpe = nn.Embedding(SEQ, HIDDEN)
        self.blocks = nn.ModuleList(MaskedBlock() for _ in range(LAYERS))
        self.head = nn.Linear(HIDDEN, models.VOCAB)

    def set_temperature(self, temperature: float | None) -> None:
        for block in self.blocks:
            block.attn.temperature = temperature

    def forward(self, input_ids: Tensor, attention_mask: Tensor, document_ids: Tensor | None = None) -> Tensor:
        length = input_ids.shape[1]
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        mask = causal[None, None] & attention_mask.bool()[:, None, None, :]
        if self.isolate:
            assert document_ids is not None
            mask = mask & (document_ids[:, None, :, None] == document_ids[:, None, None, :])
        mask = mask | torch.eye(length, dtype=torch.bool)
        x = self.wte(input_ids) + self.wpe(torch.arange(length))
        for block in self.blocks:
            x = block(x, mask)
        return self.head(x)


def packed_gpt_visible(batch: dict[str, Tensor], isolate: bool) -> Tensor:
    """The support of PackedGPT's real queries, from its rules (not from its mask tensor)."""
    b_size = batch["input_ids"].shape[0]
    return ref_dense(
        b_size,
        SEQ,
        SEQ,
        padding=batch["attention_mask"].tolist(),
        causal=True,
        documents=batch["document_ids"].tolist() if isolate else None,
    )


def packed_gpt_reference(
    model: PackedGPT, batches: list[dict[str, Tensor]], prefix: str = "", **options: Any
) -> dict[str, Tensor]:
    """Run ``model`` on ``batches`` and return the reference masses per ``{diagnostic}/{prefix}blocks.{i}.attn``."""
    parts = []
    with torch.no_grad():
        for batch in batches:
            model(batch["input_ids"], batch["attention_mask"], batch["document_ids"])
            visible = packed_gpt_visible(batch, model.isolate)
            part = {}
            for index, block in enumerate(model.blocks):
                q, k = block.attn.last
                probs = ref_probs(q, k, block.attn.scale, visible)
                for name, values in ref_masses(probs, visible, batch, **options).items():
                    part[f"{name}/{prefix}blocks.{index}.attn"] = values
            parts.append(part)
    return merge(parts)


@contextmanager
def llama_qk(model: nn.Module) -> Iterator[list[tuple[Tensor, Tensor, float]]]:
    """Recompute (q, k, scale) of every Llama attention call in float64 from its inputs (a pre-hook)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    seen: list[tuple[Tensor, Tensor, float]] = []

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        cos, sin = kwargs["position_embeddings"]
        batch, length, _ = hidden.shape
        hidden = hidden.detach().double()

        def project(linear: nn.Linear) -> Tensor:
            bias = None if linear.bias is None else linear.bias.double()
            out = F.linear(hidden, linear.weight.double(), bias)
            return out.view(batch, length, -1, module.head_dim).transpose(1, 2)

        q, k = apply_rotary_pos_emb(project(module.q_proj), project(module.k_proj), cos.double(), sin.double())
        seen.append((q, k, module.head_dim**-0.5))

    handles = [layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True) for layer in model.model.layers]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


# =========================================================================== SDPA q/k path

SCENARIOS = {
    # name: (layout, isolate, pass document ids)
    "packed-isolated": (PACKED, True, True),
    "packed-leaky": (PACKED, False, True),
    "left-padded": (LEFT_PADDED, False, False),
    "short-documents": (SHORT_DOCS, False, True),
}
OPTIONS = {"sink_tokens": 2, "policies": [(1, 4), (0, 3), (2, 1), (4, 8)], "leakage": True}


@pytest.mark.parametrize("method", ["auto", "chunked"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_sdpa_path_matches_reference(scenario: str, method: str) -> None:
    layout, isolate, with_documents = SCENARIOS[scenario]
    model = PackedGPT(isolate=isolate).eval()
    if scenario == "short-documents":
        model.set_temperature(3.0)  # an explicit scale= reaches the capture too
    batches = [make_batch(layout, seed) for seed in (1, 2)]
    diagnostics = MassDiagnostics(
        sink_tokens=OPTIONS["sink_tokens"], eviction=OPTIONS["policies"], leakage=True, method=method
    )
    with AttentionCapture(model) as capture, torch.no_grad():
        capture.consumers.append(diagnostics)
        for batch in batches:
            documents = batch["document_ids"] if with_documents else None
            with capture.recording(batch["attention_mask"], documents):
                model(batch["input_ids"], batch["attention_mask"], batch["document_ids"])
    summary = diagnostics.metric.compute()
    options = dict(OPTIONS, use_documents=with_documents)
    reference = packed_gpt_reference(model, batches, **options)
    check_summary(summary, reference)
    leakage = [key for key in summary.layers if key.startswith("leakage/")]
    if not with_documents:
        assert leakage == []  # no document ids: nothing to leak across
    elif isolate:
        for key in leakage:
            assert float(reference[key].max()) < 1e-12
            assert float(summary.mean[summary.layers.index(key)].max()) < 1e-6
    else:
        for key in leakage:
            assert float(summary.layer_mean[summary.layers.index(key)]) > 0.05
    for key in summary.layers:
        if key.startswith("sink_mass/"):
            assert float(summary.layer_mean[summary.layers.index(key)]) > 0.05


def test_additive_bias_mask_matches_reference() -> None:
    """An SDPA float mask with an ALiBi-style bias (no fused kernel takes it): the exact path, biased logits."""
    generator = torch.Generator().manual_seed(8)
    batch = make_batch([(0, [6, 10], 0), (4, [5, 7], 0)], seed=8)
    q, k, v = (torch.randn(2, HEADS, SEQ, HEAD_DIM, generator=generator) for _ in range(3))
    visible = ref_dense(2, SEQ, SEQ, padding=batch["attention_mask"].tolist(), causal=True) | torch.eye(SEQ).bool()
    distance = torch.arange(SEQ)[None, :] - torch.arange(SEQ)[:, None]
    bias = torch.tensor([0.5, 0.25, 0.125, 0.0625])[:, None, None] * distance.clamp(max=0)  # (H, N, N)
    mask = torch.where(visible, bias, torch.tensor(-math.inf))  # (B, H, N, N)
    diagnostics = MassDiagnostics(sink_tokens=2, eviction=[(1, 4), (0, 2)], leakage=True)
    with AttentionCapture(nn.Identity()) as capture:
        capture.consumers.append(diagnostics)
        with capture.recording(batch["attention_mask"], batch["document_ids"]):
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    probs = ref_probs(q, k, 1 / math.sqrt(HEAD_DIM), visible, bias)
    masses = ref_masses(probs, visible, batch, sink_tokens=2, policies=[(1, 4), (0, 2)], leakage=True)
    check_summary(diagnostics.metric.compute(), {f"{name}/sdpa_call_0": values for name, values in masses.items()})


def test_chunked_and_fused_agree_on_every_query() -> None:
    """Both logsumexp paths give each query the same mass (seen through a recording consumer)."""
    batch = make_batch(PACKED, seed=5)
    results = {}
    for method in ("fused", "chunked"):
        model = PackedGPT(isolate=False).eval()
        metric = AttentionMass(num_bins=10)
        diagnostics = MassDiagnostics(sink_tokens=1, eviction=[(1, 4)], leakage=True, metric=metric, method=method)
        with AttentionCapture(model) as capture, torch.no_grad():
            capture.consumers.append(diagnostics)
            with capture.recording(batch["attention_mask"], batch["document_ids"]):
                model(batch["input_ids"], batch["attention_mask"])
        results[method] = metric.compute()
    torch.testing.assert_close(results["fused"].stats("sum"), results["chunked"].stats("sum"), atol=1e-5, rtol=0)
    assert torch.equal(results["fused"].count, results["chunked"].count)


# =========================================================================== probability path


def test_probability_adapter_matches_reference() -> None:
    """EagerLM's Mixer returns (out, probs); an adapter reads them. Left and right padding, packed ids."""
    model = models.EagerLM().eval()
    layout = [(2, [4, 10], 0), (0, [7, 5], 4), (0, [16], 0)]
    batches = [make_batch(layout, seed) for seed in (3, 4)]
    inputs: list[Tensor] = []
    handles = [
        block.mixer.register_forward_pre_hook(lambda m, args: inputs.append(args[0].detach().double()))
        for block in model.blocks
    ]
    diagnostics = MassDiagnostics(sink_tokens=1, eviction=[(1, 4), (0, 2)], leakage=True)
    try:
        with AttentionCapture(model, adapters={"blocks.*.mixer": probabilities_at(1)}) as capture, torch.no_grad():
            capture.consumers.append(diagnostics)
            for batch in batches:
                with capture.recording(batch["attention_mask"], batch["document_ids"]):
                    model(batch["input_ids"], batch["attention_mask"].bool())
    finally:
        for handle in handles:
            handle.remove()
    parts = []
    for number, batch in enumerate(batches):
        visible = ref_dense(3, SEQ, SEQ, padding=batch["attention_mask"].tolist(), causal=True)
        part = {}
        for index, block in enumerate(model.blocks):
            x = inputs[number * LAYERS + index]
            weight, bias = block.mixer.qkv.weight.detach().double(), block.mixer.qkv.bias.detach().double()
            q, k, _ = (
                t.view(3, SEQ, HEADS, HEAD_DIM).transpose(1, 2) for t in F.linear(x, weight, bias).split(HIDDEN, -1)
            )
            probs = ref_probs(q, k, 1 / math.sqrt(HEAD_DIM), visible)
            masses = ref_masses(probs, visible, batch, sink_tokens=1, policies=[(1, 4), (0, 2)], leakage=True)
            part.update({f"{name}/blocks.{index}.mixer": values for name, values in masses.items()})
        parts.append(part)
    summary = diagnostics.metric.compute()
    check_summary(summary, merge(parts))
    assert float(summary.layer_mean[summary.layers.index("leakage/blocks.0.mixer")]) > 0.05


def test_hf_eager_llama_left_padding_matches_reference() -> None:
    """Hugging Face eager Llama (probabilities found automatically), left padding, packed document ids."""
    model = models.hf_model("llama", "eager")
    layout = [(4, [12], 0), (0, [9, 7], 0), (7, [4, 5], 0)]
    batch = make_batch(layout, seed=7)
    diagnostics = MassDiagnostics(sink_tokens=2, eviction=[(1, 4), (0, 5)], leakage=True)
    with llama_qk(model) as seen, AttentionCapture(model) as capture, torch.no_grad():
        capture.consumers.append(diagnostics)
        with capture.recording(batch["attention_mask"], batch["document_ids"]):
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    visible = ref_dense(3, SEQ, SEQ, padding=batch["attention_mask"].tolist(), causal=True)
    reference = {}
    for index, (q, k, scale) in enumerate(seen):
        probs = ref_probs(q, k, scale, visible)
        masses = ref_masses(probs, visible, batch, sink_tokens=2, policies=[(1, 4), (0, 5)], leakage=True)
        reference.update({f"{name}/model.layers.{index}.self_attn": values for name, values in masses.items()})
    check_summary(diagnostics.metric.compute(), reference)


# =========================================================================== evaluate_attention


def test_evaluate_attention_with_mass_diagnostics_on_hf_llama() -> None:
    model = models.hf_model("llama", "sdpa")  # grouped-query attention: 4 query heads, 2 key heads
    batches = [make_batch(PACKED, 11), make_batch([(0, [8, 8], 0), (0, [3, 13], 0), (0, [16], 0)], 12)]
    diagnostics = MassDiagnostics(sink_tokens=1, eviction=[(1, 4), (0, 4)], leakage=True)
    with llama_qk(model) as seen:
        summary = evaluate_attention(model, batches, consumers=[diagnostics])
    assert summary.layers == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    parts = []
    for number, batch in enumerate(batches):
        visible = ref_dense(3, SEQ, SEQ, padding=batch["attention_mask"].tolist(), causal=True)
        part = {}
        for index in range(LAYERS):
            q, k, scale = seen[number * LAYERS + index]
            probs = ref_probs(q, k, scale, visible)
            masses = ref_masses(probs, visible, batch, sink_tokens=1, policies=[(1, 4), (0, 4)], leakage=True)
            part.update({f"{name}/model.layers.{index}.self_attn": values for name, values in masses.items()})
        parts.append(part)
    masses = diagnostics.metric.compute()
    check_summary(masses, merge(parts))
    scalars = masses.to_dict()
    for index in range(LAYERS):
        assert scalars[f"attn_leakage/model.layers.{index}.self_attn/mean"] > 0.05  # plain causal mask leaks


# =========================================================================== leading_keys


LEADING_CASES = {
    "no padding": (None, None),
    "left padding": ([[0, 0, 1, 1, 1, 1, 1, 1], [1] * 8, [0] * 7 + [1]], None),
    "right padding": ([[1, 1, 1, 0, 0, 0, 0, 0], [1] * 8, [1] + [0] * 7], None),
    "documents": (None, [[0, 0, 0, 1, 1, 2, 2, 2], [0] * 8, [0, 1, 2, 3, 4, 5, 6, 7]]),
    "documents and padding": (
        [[0, 1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0, 0, 0], [0, 0, 0, 1, 1, 1, 1, 1]],
        [[-1, 0, 0, 1, 1, 1, 2, 3], [0, 0, 1, 1, 2, 2, 2, 2], [-1, -1, -1, 0, 0, 0, 0, 0]],
    ),
    "padding inside a document": ([[1, 0, 1, 1, 0, 1, 1, 1]], [[0, 0, 0, 1, 1, 1, 1, 1]]),
}


@pytest.mark.parametrize("count", [1, 2, 3, 10])
@pytest.mark.parametrize("case", list(LEADING_CASES))
def test_leading_keys_matches_loop_reference(case: str, count: int) -> None:
    padding, documents = LEADING_CASES[case]
    got = leading_keys(
        count,
        None if padding is None else torch.tensor(padding),
        None if documents is None else torch.tensor(documents),
        8,
    )
    assert got.dtype == torch.bool
    assert got.tolist() == ref_leading(count, padding, documents, 8)


def test_leading_keys_random_layouts() -> None:
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        lengths = torch.randint(1, 6, (6,), generator=generator).tolist()
        documents = [d for d, n in enumerate(lengths) for _ in range(n)][:SEQ]
        documents += [documents[-1] + 1] * (SEQ - len(documents))
        padding = (torch.rand(SEQ, generator=generator) > 0.3).long().tolist()
        count = int(torch.randint(1, 5, (), generator=generator))
        got = leading_keys(count, torch.tensor([padding]), torch.tensor([documents]), SEQ)
        assert got.tolist() == ref_leading(count, [padding], [documents], SEQ)


def test_leading_keys_bad_input() -> None:
    for count in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="positive int"):
            leading_keys(count, None, None, 4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="padding_mask"):
        leading_keys(1, torch.ones(2, 5, dtype=torch.bool), None, 4)


# =========================================================================== Support derivations

PAD = [[1, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 1]]
DOCS = [[0, 0, 1, 1, 1, 2, 2], [-1, -1, 0, 0, 0, 1, 1]]
KEYS = [[True, False, True, False, False, True, True], [False, True, True, False, True, False, True]]
N7 = 7


def _explicit() -> Tensor:
    return torch.rand(2, HEADS, N7, N7, generator=torch.Generator().manual_seed(3)) > 0.4


def _check(support: Support, want: Tensor) -> None:
    """num_valid and dense of ``support`` equal the reference (B, H or 1, Nq, Nk)."""
    shape = (want.shape[0], want.shape[1], support.num_queries)
    assert torch.equal(support.num_valid().expand(shape), want.sum(-1)), (support, support.num_valid(), want.sum(-1))
    assert torch.equal(support.dense().expand(want.shape), want), support


BASES = {
    # name: (Support kwargs, reference kwargs)
    "plain": ({}, {}),
    "causal padding": ({"padding_mask": torch.tensor(PAD), "causal": True}, {"padding": PAD, "causal": True}),
    "window": ({"causal": True, "window": 3}, {"causal": True, "window": 3}),
    "explicit": ({"mask": "explicit"}, {"explicit": "explicit"}),
    "explicit causal padding": (
        {"mask": "explicit", "causal": True, "padding_mask": torch.tensor(PAD)},
        {"explicit": "explicit", "causal": True, "padding": PAD},
    ),
}


def _build(name: str) -> tuple[Support, dict[str, Any]]:
    kwargs, ref = (dict(part) for part in BASES[name])
    explicit = _explicit()
    heads = 1
    if kwargs.get("mask") == "explicit":
        kwargs["mask"], ref["explicit"], heads = explicit, explicit, HEADS
    ref["heads"] = heads
    return Support(N7, **kwargs), ref


@pytest.mark.parametrize("base", list(BASES))
def test_restrict_keys_is_the_intersection(base: str) -> None:
    support, ref = _build(base)
    before = support.num_valid().clone()
    derived = support.restrict_keys(torch.tensor(KEYS))
    _check(derived, ref_dense(2, N7, N7, keys=KEYS, **ref))
    assert torch.equal(support.num_valid(), before)  # the original is untouched
    # Which queries are samples comes from the original's query mask, not from the restricted keys.
    query_mask = support.query_mask
    assert (derived.query_mask is None) == (query_mask is None)
    if query_mask is not None:
        assert torch.equal(derived.query_mask, query_mask)
    # Chaining intersects again.
    other = [[True] * N7, [False] * 3 + [True] * 4]
    both = [[a and b for a, b in zip(x, y, strict=True)] for x, y in zip(KEYS, other, strict=True)]
    _check(derived.restrict_keys(torch.tensor(other)), ref_dense(2, N7, N7, keys=both, **ref))


@pytest.mark.parametrize("window", [1, 2, 3, 5, 20])
@pytest.mark.parametrize("base", list(BASES))
def test_with_window_is_the_intersection(base: str, window: int) -> None:
    support, ref = _build(base)
    derived = support.with_window(window)
    ref_window = ref.pop("window", None)
    effective = window if ref_window is None else min(window, ref_window)
    ref.pop("causal", None)
    want = ref_dense(2 if "padding" in ref or "explicit" in ref else 1, N7, N7, causal=True, window=effective, **ref)
    _check(derived, want)
    assert derived.window == effective and derived.causal
    # The additive mask of the derived support hides exactly the hidden keys.
    additive, is_causal = derived.additive_mask(torch.float32)
    assert not is_causal
    assert torch.equal(torch.isfinite(additive).expand(want.shape), want)


@pytest.mark.parametrize("base", list(BASES))
def test_with_documents_is_the_intersection(base: str) -> None:
    support, ref = _build(base)
    derived = support.with_documents(torch.tensor(DOCS))
    _check(derived, ref_dense(2, N7, N7, documents=DOCS, **ref))
    # Combined with the other derivations, in either order.
    combined = derived.with_window(2).restrict_keys(torch.tensor(KEYS))
    reordered = support.restrict_keys(torch.tensor(KEYS)).with_window(2).with_documents(torch.tensor(DOCS))
    ref.pop("causal", None)
    effective = min(2, ref.pop("window", 2))
    want = ref_dense(2, N7, N7, documents=DOCS, keys=KEYS, causal=True, window=effective, **ref)
    _check(combined, want)
    _check(reordered, want)


def test_support_derivations_reject_bad_input() -> None:
    support = Support(N7, padding_mask=torch.tensor(PAD), causal=True)
    with pytest.raises(ValueError, match="keys"):
        support.restrict_keys(torch.ones(2, N7 + 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="keys"):
        support.restrict_keys(torch.ones(N7, dtype=torch.bool))
    with pytest.raises(TypeError, match="keys"):
        support.restrict_keys(torch.ones(2, N7))
    for window in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="window"):
            support.with_window(window)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="contiguous"):
        support.with_documents(torch.tensor([[0, 1, 0, 1, 1, 1, 1], [0] * N7]))
    once = support.with_documents(torch.tensor(DOCS))  # the same documents twice are the same set
    assert torch.equal(once.with_documents(torch.tensor(DOCS)).num_valid(), once.num_valid())
    with pytest.raises(ValueError, match="batch size"):
        support.with_documents(torch.zeros(3, N7, dtype=torch.long))


# =========================================================================== bad input


@pytest.mark.parametrize("sink_tokens", [0, -1, 1.0, True, "2"])
def test_sink_tokens_must_be_positive_int(sink_tokens: Any) -> None:
    with pytest.raises(ValueError, match="sink_tokens"):
        MassDiagnostics(sink_tokens=sink_tokens)
    with pytest.raises(ValueError, match="sink_tokens"):
        AttentionEntropyMonitor(statistics=Statistics(sink_tokens=sink_tokens))


@pytest.mark.parametrize(
    "policy",
    [(1,), (1, 4, 2), (-1, 4), (1, 0), (1, -3), (1.0, 4), (1, 4.0), (True, 4), (1, None), "14", ()],
)
def test_malformed_eviction_policy_is_named(policy: Any) -> None:
    with pytest.raises(ValueError, match="eviction policy") as error:
        MassDiagnostics(eviction=[(1, 4), policy])
    assert repr(policy if isinstance(policy, str) else tuple(policy)) in str(error.value)
    with pytest.raises(ValueError, match="eviction policy"):
        AttentionEntropyMonitor(statistics=Statistics(eviction=[policy]))


def test_eviction_given_as_one_bare_policy_is_a_clear_error() -> None:
    """``eviction=(1, 4)`` instead of ``[(1, 4)]`` is an easy slip; the error should say what was expected.

    Fails today: ``_check_policies`` calls ``len(1)`` and raises
    ``TypeError: object of type 'int' has no len()``, which names neither
    ``eviction`` nor the expected shape.
    """
    with pytest.raises((ValueError, TypeError), match="eviction"):
        MassDiagnostics(eviction=(1, 4))  # type: ignore[arg-type]


def test_attention_mass_update_rejects_bad_values_and_shapes() -> None:
    metric = AttentionMass()
    for bad in (1.5, -0.2, 1 + 1e-3):
        with pytest.raises(ValueError, match=r"\[0, 1\]"):
            metric.update("sink_mass/x", torch.full((1, 2, 3), bad))
    with pytest.raises(ValueError, match="3 dims"):
        metric.update("sink_mass/x", torch.rand(2, 3))
    with pytest.raises(ValueError, match="3 dims"):
        metric.update("sink_mass/x", torch.rand(1, 1, 2, 3))
    with pytest.raises(TypeError, match="floating point"):
        metric.update("sink_mass/x", torch.ones(1, 2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="is_sample"):
        metric.update("sink_mass/x", torch.rand(1, 2, 3), torch.ones(1, 2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="is_sample"):
        metric.update("sink_mass/x", torch.rand(1, 2, 3), torch.ones(1, 2, 3))
    assert metric.layers == []  # nothing registered by rejected updates
    # Out-of-range values on queries that do not count, and NaN, are ignored.
    mass = torch.tensor([[[0.25, 7.0, math.nan]]])
    metric.update("sink_mass/x", mass, torch.tensor([[[True, False, True]]]))
    summary = metric.compute()
    assert summary.count.tolist() == [[1.0]] and summary.mean.tolist() == [[0.25]]


# =========================================================================== Lightning


class PackedModule(pl.LightningModule):
    """A LightningModule around :class:`PackedGPT`; batches carry ``document_ids``.

    The non-isolating model never sees ``document_ids`` (the key is dropped
    before the call); the isolating one builds its block-diagonal mask from it.
    """

    def __init__(self, isolate: bool, lr: float = 1e-2, seed: int = 0) -> None:
        super().__init__()
        self.lr = lr
        self.model = PackedGPT(isolate=isolate, seed=seed)

    def forward(self, batch: dict[str, Tensor]) -> Tensor:
        inputs = {key: value for key, value in batch.items() if key != "document_ids"}
        if self.model.isolate:
            inputs["document_ids"] = batch["document_ids"]
        return self.model(**inputs)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return lm.lm_loss(self(batch), batch)

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self.log("val_loss", lm.lm_loss(self(batch), batch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


LAYER_NAMES = ["model.blocks.0.attn", "model.blocks.1.attn"]
TRAIN = [make_batch(PACKED, seed) for seed in range(20, 22)]
VAL = [make_batch(PACKED, 30), make_batch([*SHORT_DOCS, (0, [16], 0)], 31), make_batch(PACKED, 32)]


class Temperature(pl.Callback):
    """Set the attention temperature at the start of each training epoch: ``schedule[epoch]``."""

    def __init__(self, schedule: Sequence[float | None]) -> None:
        self.schedule = list(schedule)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pl_module.model.set_temperature(self.schedule[min(trainer.current_epoch, len(self.schedule) - 1)])


def fit(
    root: Path,
    monitor: AttentionEntropyMonitor,
    *,
    isolate: bool = False,
    logger: Any = None,
    callbacks: Sequence[pl.Callback] = (),
    max_epochs: int = 2,
    lr: float = 1e-2,
) -> tuple[pl.Trainer, PackedModule]:
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=max_epochs,
        num_sanity_val_steps=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        log_every_n_steps=1,
        default_root_dir=str(root),
        logger=logger if logger is not None else lm.MemoryLogger(),
        callbacks=[monitor, *callbacks],
    )
    module = PackedModule(isolate=isolate, lr=lr)
    trainer.fit(module, lm.loader(TRAIN), lm.loader(VAL))
    return trainer, module


def monitor_options(**kwargs: Any) -> dict[str, Any]:
    options: dict[str, Any] = {"log": LogOptions(histogram_bins=None, heatmap=False, per_head=False)}
    options.update(kwargs)
    return options


def reference_means(state: dict[str, Tensor], isolate: bool, temperature: float | None = None) -> dict[str, float]:
    """Logged-name -> reference layer mean on the first two validation batches, with the recorded weights."""
    module = PackedModule(isolate=isolate)
    module.load_state_dict(state)
    module.model.set_temperature(temperature)
    reference = packed_gpt_reference(
        module.model.eval(), VAL[:2], prefix="model.", sink_tokens=1, policies=[(1, 4)], leakage=True
    )
    return {f"attn_{key}/mean": float(values.mean()) for key, values in reference.items()}


def read_csv_rows(path: str) -> list[dict[str, str]]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def _warnings_matching(record: Any, text: str) -> list[str]:
    return [str(w.message) for w in record if text in str(w.message)]


def test_fit_logs_sink_coverage_leakage_matching_reference(tmp_path: Path) -> None:
    """Non-isolating packed model, CSV logger, 2 epochs: names, values, one leakage warning, saved summaries."""
    monitor = AttentionEntropyMonitor(
        **monitor_options(statistics=Statistics(sink_tokens=1, eviction=[(1, 4)], leakage=True), save_summaries=True)
    )
    recorder = lm.BatchRecorder()
    logger = CSVLogger(tmp_path, name="csv")
    with pytest.warns(UserWarning, match="packed documents") as record:
        trainer, _ = fit(tmp_path, monitor, logger=logger, callbacks=[recorder])
    leak_warnings = _warnings_matching(record, "packed documents")
    assert len(leak_warnings) == 1, leak_warnings
    assert all(layer in leak_warnings[0] for layer in LAYER_NAMES)

    rows = read_csv_rows(os.path.join(logger.log_dir, "metrics.csv"))
    assert len(recorder.validations) == 2
    for validation in recorder.validations:
        want = reference_means(validation["state"], isolate=False)
        assert set(want) == {
            f"attn_{diag}/{layer}/mean" for diag in ("sink_mass", "coverage_s1_w4", "leakage") for layer in LAYER_NAMES
        }
        step = validation["step"] - 1  # Lightning logs validation metrics at the steps before the last batch's
        logged = [row for row in rows if row.get("step") == str(step) and row.get(next(iter(want)))]
        assert len(logged) == 1, (step, logged)
        for name, value in want.items():
            assert abs(float(logged[0][name]) - value) <= MEAN_TOL, (name, logged[0][name], value)
        for layer in LAYER_NAMES:
            assert float(logged[0][f"attn_leakage/{layer}/mean"]) > 0.05
            assert float(logged[0][f"attn_sink_mass/{layer}/mean"]) > 0.05
            assert 0.0 < float(logged[0][f"attn_coverage_s1_w4/{layer}/mean"]) < 1.0

    # save_summaries: one loadable file per monitored epoch, the last equal to last_summary.
    directory = os.path.join(trainer.log_dir, "attn_entropy")
    assert sorted(os.listdir(directory)) == ["epoch0.pt", "epoch1.pt"]
    saved = load_summary(os.path.join(directory, "epoch1.pt"))
    last = monitor.last_summary
    assert last is not None and saved.layers == last.layers == LAYER_NAMES
    assert saved.num_heads == last.num_heads
    for kind in ("hist", "hist_nats", "count", "sum", "sum_sq", "sum_nats", "seq_sum", "seq_count"):
        assert torch.equal(saved.stats(kind), last.stats(kind)), kind
    first = load_summary(os.path.join(directory, "epoch0.pt"))
    assert not torch.equal(first.stats("sum"), last.stats("sum"))  # weights changed between epochs


def test_fit_isolating_model_no_leakage_no_collapse_at_threshold_zero(tmp_path: Path) -> None:
    monitor = AttentionEntropyMonitor(
        **monitor_options(
            statistics=Statistics(sink_tokens=1, eviction=[(1, 4)], leakage=True), alerts=[CollapseAlert(0.0)]
        )
    )
    recorder = lm.BatchRecorder()
    logger = lm.MemoryLogger()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(tmp_path, monitor, isolate=True, logger=logger, callbacks=[recorder])
    assert _warnings_matching(record, "packed documents") == []
    assert _warnings_matching(record, "collapse") == []
    for layer in LAYER_NAMES:
        leakage = logger.values_of(f"attn_leakage/{layer}/mean")
        assert len(leakage) == 2 and max(leakage) < 1e-6, leakage
        assert logger.values_of(f"attn_entropy/{layer}/collapsed_heads") == [0.0, 0.0]
    for validation in recorder.validations:
        want = reference_means(validation["state"], isolate=True)
        [logged] = [m for step, m in logger.records if step == validation["step"] - 1 and next(iter(want)) in m]
        for name, value in want.items():
            assert abs(logged[name] - value) <= MEAN_TOL, (name, logged[name], value)


def test_collapse_threshold_above_medians_warns_names_layer_and_heads(tmp_path: Path) -> None:
    monitor = AttentionEntropyMonitor(**monitor_options(alerts=[CollapseAlert(1.0)]))
    logger = lm.MemoryLogger()
    with pytest.warns(UserWarning, match="entropy collapse") as record:
        fit(tmp_path, monitor, logger=logger)
    medians = monitor.last_summary.quantile(0.5)
    assert (medians < 1.0).all()  # the threshold is above every observed median
    alerts = _warnings_matching(record, "entropy collapse")
    assert all(w.category is UserWarning for w in record if "entropy collapse" in str(w.message))
    assert len(alerts) == LAYERS, alerts  # once per head: all heads of both layers at epoch 0, none after
    for layer, alert in zip(LAYER_NAMES, alerts, strict=True):
        assert repr(layer) in alert and "heads [0, 1, 2, 3]" in alert
    for layer in LAYER_NAMES:
        assert logger.values_of(f"attn_entropy/{layer}/collapsed_heads") == [4.0, 4.0]


def test_stop_on_collapse_stops_training(tmp_path: Path) -> None:
    monitor = AttentionEntropyMonitor(**monitor_options(alerts=[CollapseAlert(1.0, stop=True)]))
    logger = lm.MemoryLogger()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer, _ = fit(tmp_path, monitor, logger=logger, max_epochs=4)
    assert trainer.should_stop
    assert trainer.current_epoch < 4 - 1
    assert len(logger.values_of(f"attn_entropy/{LAYER_NAMES[0]}/collapsed_heads")) == 1


def test_collapse_drop_relative_to_first_epoch_and_state_round_trip(tmp_path: Path) -> None:
    """Temperature 1 at epoch 0, 8 at epoch 1 (lr 0): medians fall, the drop alert fires at epoch 1 only."""
    monitor = AttentionEntropyMonitor(**monitor_options(alerts=[CollapseAlert(drop=0.2)]))
    logger = lm.MemoryLogger()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(tmp_path / "a", monitor, logger=logger, callbacks=[Temperature([None, 8.0])], lr=0.0)
    counts = {layer: logger.values_of(f"attn_entropy/{layer}/collapsed_heads") for layer in LAYER_NAMES}
    for layer in LAYER_NAMES:
        assert counts[layer][0] == 0.0 and counts[layer][1] > 0.0, counts
    alerts = _warnings_matching(record, "entropy collapse")
    assert alerts and all("first monitored epoch" in alert for alert in alerts)
    first = monitor.core.alerts[0].baselines[0]
    assert first is not None and first.shape == (LAYERS, HEADS)
    assert (monitor.last_summary.quantile(0.5) < first).all()

    # State round trip (through torch.save with weights_only=True, as a checkpoint would be read).
    state = monitor.state_dict()
    torch.save(state, tmp_path / "state.pt")
    loaded = torch.load(tmp_path / "state.pt", weights_only=True)
    restored = AttentionEntropyMonitor(**monitor_options(alerts=[CollapseAlert(drop=0.2)]))
    restored.load_state_dict(loaded)
    assert torch.equal(restored.core.alerts[0].baselines[0], first)

    # The restored baseline is what later drops are measured against: a sharp model alerts at once ...
    logger = lm.MemoryLogger()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(tmp_path / "b", restored, logger=logger, callbacks=[Temperature([8.0])], lr=0.0, max_epochs=1)
    assert _warnings_matching(record, "entropy collapse")
    assert logger.values_of(f"attn_entropy/{LAYER_NAMES[0]}/collapsed_heads")[0] > 0.0
    # ... while a fresh monitor takes the sharp epoch itself as its baseline.
    fresh = AttentionEntropyMonitor(**monitor_options(alerts=[CollapseAlert(drop=0.2)]))
    logger = lm.MemoryLogger()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(tmp_path / "c", fresh, logger=logger, callbacks=[Temperature([8.0])], lr=0.0, max_epochs=1)
    assert _warnings_matching(record, "entropy collapse") == []
    assert logger.values_of(f"attn_entropy/{LAYER_NAMES[0]}/collapsed_heads") == [0.0]


def test_training_step_recording_does_not_leak_into_validation_masses(tmp_path: Path) -> None:
    """With ``train_every_n_steps`` the logged validation masses must still be those of the validation batches.

    Fails today: the MassDiagnostics consumer is always attached to the
    capture and updates its one metric during recorded *training* steps too
    (callback.py ``on_train_batch_start`` only swaps the entropy metric), so
    the sink mass logged at validation pools training and validation queries.
    """
    monitor = AttentionEntropyMonitor(
        **monitor_options(
            statistics=Statistics(sink_tokens=1, eviction=[(1, 4)]), batches=Batches(train_every_n_steps=1)
        )
    )
    recorder = lm.BatchRecorder()
    logger = lm.MemoryLogger()
    fit(tmp_path, monitor, logger=logger, callbacks=[recorder], max_epochs=1)
    want = reference_means(recorder.validations[0]["state"], isolate=False)
    name = f"attn_sink_mass/{LAYER_NAMES[0]}/mean"
    logged = logger.values_of(name)
    assert len(logged) == 1
    assert abs(logged[0] - want[name]) <= MEAN_TOL, (logged[0], want[name])


# =========================================================================== documents the support already has

#: Coarser documents than PACKED's: the mask of the model isolates halves of each row.
HALVES = [[0] * (SEQ // 2) + [1] * (SEQ // 2)] * len(PACKED)


def _documents_call(mask_documents: list[list[int]], batch: dict[str, Tensor], probs: bool) -> AttentionCall:
    """A call whose support already isolates ``mask_documents`` (causal, padded); q/k or float32 probabilities."""
    generator = torch.Generator().manual_seed(21)
    q, k = (torch.randn(len(PACKED), HEADS, SEQ, HEAD_DIM, generator=generator) for _ in range(2))
    support = Support(SEQ, padding_mask=batch["attention_mask"], causal=True, document_ids=torch.tensor(mask_documents))
    common = {"padding_mask": batch["attention_mask"], "document_ids": batch["document_ids"]}
    if not probs:
        return AttentionCall("attn", support, q=q, k=k, **common)
    logits = (q @ k.transpose(-1, -2) / math.sqrt(HEAD_DIM)).masked_fill(~support.dense(), -math.inf)
    return AttentionCall("attn", support, probs=logits.softmax(-1).nan_to_num(0.0), **common)


def _consume(call: AttentionCall, **options: Any) -> MassSummary:
    diagnostics = MassDiagnostics(**options)
    sample = call.support.is_sample() & call.padding_mask.bool()[:, None, :]
    diagnostics(call, sample)
    return diagnostics.metric.compute()


@pytest.mark.parametrize("probs", [False, True], ids=["qk", "probs"])
@pytest.mark.parametrize("mask_documents", ["same", "coarser"])
def test_support_with_documents_given_again_is_intersected(mask_documents: str, probs: bool) -> None:
    """A mask that already isolates documents, and the batch's documents on top: their intersection."""
    batch = make_batch(PACKED, seed=21)
    documents = batch["document_ids"].tolist() if mask_documents == "same" else HALVES
    call = _documents_call(documents, batch, probs)
    summary = _consume(call, sink_tokens=2, eviction=[(1, 4), (0, 3)], leakage=True)
    padding = batch["attention_mask"].tolist()
    visible = ref_dense(len(PACKED), SEQ, SEQ, padding=padding, causal=True, documents=documents)
    generator = torch.Generator().manual_seed(21)
    q, k = (torch.randn(len(PACKED), HEADS, SEQ, HEAD_DIM, generator=generator) for _ in range(2))
    reference = ref_probs(q, k, 1 / math.sqrt(HEAD_DIM), visible)
    masses = ref_masses(reference, visible, batch, sink_tokens=2, policies=[(1, 4), (0, 3)], leakage=True)
    assert float(masses["sink_mass"].std()) > 0.05  # spread: the check below can tell values apart
    check_summary(summary, {f"{name}/attn": values for name, values in masses.items()})


@pytest.mark.parametrize("probs", [False, True], ids=["qk", "probs"])
def test_isolating_mask_leaks_exactly_zero(probs: bool) -> None:
    """Mass on other documents is summed, not 1 - own mass: an isolating mask reads 0.0, not ~1e-8."""
    batch = make_batch(PACKED, seed=22)
    call = _documents_call(batch["document_ids"].tolist(), batch, probs)
    summary = _consume(call, leakage=True)
    index = summary.layers.index("leakage/attn")
    assert summary.count[index].sum() > 0
    assert float(summary.stats("sum")[index].abs().max()) == 0.0


# =========================================================================== sink rate


def test_sink_rate_matches_the_float64_share_of_sink_heads() -> None:
    """Per layer the share of heads whose mean sink mass exceeds eps, against the reference per-query masses.

    eps is set between the heads' reference means of a layer (so the share is neither 0 nor 1), and the
    default eps = 0.3 is read from the logged name. Fails when the heads' medians stand in for their
    means; the next test fails when the share is over all head slots instead of heads with a counted query.
    """
    model = PackedGPT(isolate=True).eval()
    batches = [make_batch(PACKED, seed) for seed in (1, 2)]
    diagnostics = MassDiagnostics(sink_tokens=2)
    with AttentionCapture(model) as capture, torch.no_grad():
        capture.consumers.append(diagnostics)
        for batch in batches:
            with capture.recording(batch["attention_mask"], batch["document_ids"]):
                model(batch["input_ids"], batch["attention_mask"], batch["document_ids"])
    summary = diagnostics.metric.compute()
    reference = packed_gpt_reference(model, batches, sink_tokens=2, policies=[], leakage=False, use_documents=True)
    names = summary.to_dict()
    spread = False
    for key, values in reference.items():
        index = summary.layers.index(key)
        head_means = sorted(float(values[h].mean()) for h in range(values.shape[0]))
        eps = (head_means[0] + head_means[-1]) / 2
        spread |= head_means[-1] - head_means[0] > 0.02
        want = sum(mean > eps for mean in head_means) / len(head_means)
        assert float(summary.head_share_above(eps)[index]) == pytest.approx(want)
        default = sum(mean > 0.3 for mean in head_means) / len(head_means)
        assert names[f"attn_{key}/sink_rate"] == pytest.approx(default)
    assert spread, "the heads' sink masses are too alike to tell a wrong share apart"
    assert not any(name.endswith("/sink_rate") for name in summary.to_dict(sink_threshold=None))


def test_sink_rate_counts_only_heads_with_queries_and_rejects_bad_thresholds() -> None:
    metric = AttentionMass({"sink_mass/a": 3})
    mass = torch.tensor([[[0.9, 0.8], [0.1, 0.2], [0.5, 0.5]]])
    metric.update("sink_mass/a", mass, torch.tensor([[[True, True], [True, True], [False, False]]]))
    metric.update("leakage/a", mass)
    summary = metric.compute()
    assert summary.head_share_above(0.3).tolist() == [0.5, 2 / 3]
    assert "attn_leakage/a/sink_rate" not in summary.to_dict()
    for bad in (-0.1, 1.0, math.nan, True):
        with pytest.raises(ValueError, match="mass `threshold`"):
            summary.head_share_above(bad)
