"""FlexAttention calls against an independent float64 reference.

A small model whose attention calls
``torch.nn.attention.flex_attention.flex_attention`` runs with document
masking, a sliding window, an ALiBi-like ``score_mod`` and a tanh soft-cap.
The reference never imports attn_monitor: forward hooks hand each attention
layer's input to the test, which recomputes q and k from the layer's weights
in float64, writes the documented score modification and mask out cell by
cell, and pools normalised entropy per head (``reference.head_means``).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator

import pytest
import torch
from torch import Tensor, nn

from attn_monitor.capture.consumers import MassDiagnostics, StatisticsUpdate
from attn_monitor.capture.hooks import AttentionCapture
from attn_monitor.functional.flex import block_mask_support
from tests.helpers import reference

flex = pytest.importorskip("torch.nn.attention.flex_attention")

TOL = 1e-4
SPREAD = 0.02
BATCH, SEQ, HIDDEN, HEADS, KV_HEADS, LAYERS = 2, 40, 32, 4, 2, 2
BLOCK = 16  # several query and key blocks, full and partial ones
WINDOW = 7
CAP = 1.5
SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625])
#: Packed documents per row: lengths 13 + 20 + 7 and 25 + 15.
DOCUMENTS = torch.tensor([[0] * 13 + [1] * 20 + [2] * 7, [0] * 25 + [1] * 15])


@pytest.fixture(autouse=True)
def _quiet_flex() -> Iterator[None]:
    # Eager flex on CPU warns that it materialises the scores; that is what it does here.
    with warnings.catch_warnings(), torch.no_grad():
        warnings.filterwarnings("ignore", message=".*flex_attention.*", category=UserWarning)
        yield


class FlexSelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.k_proj = nn.Linear(HIDDEN, HIDDEN // HEADS * KV_HEADS, bias=False)
        self.v_proj = nn.Linear(HIDDEN, HIDDEN // HEADS * KV_HEADS, bias=False)
        self.o_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        with torch.no_grad():  # large logits, so heads differ and a soft-cap matters
            self.q_proj.weight.mul_(4.0)

    def forward(self, x: Tensor, block_mask: object, score_mod: object) -> Tensor:
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, HEADS, -1).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, KV_HEADS, -1).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, KV_HEADS, -1).transpose(1, 2)
        out = flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, HIDDEN))


class FlexLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(50, HIDDEN)
        self.layers = nn.ModuleList(FlexSelfAttention() for _ in range(LAYERS))

    def forward(self, ids: Tensor, block_mask: object = None, score_mod: object = None) -> Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = x + layer(x, block_mask, score_mod)
        return x


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _document(b, h, q_idx, kv_idx):
    return (DOCUMENTS[b, q_idx] == DOCUMENTS[b, kv_idx]) & (q_idx >= kv_idx)


def _window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < WINDOW)


def _alibi(score, b, h, q_idx, kv_idx):
    return score + SLOPES[h] * (kv_idx - q_idx)


def _softcap(score, b, h, q_idx, kv_idx):
    return CAP * torch.tanh(score / CAP)


#: case -> (mask_mod or None, batch-dependent mask, score_mod or None).
CASES = {
    "document": (_document, True, None),
    "window": (_window, False, None),
    "alibi": (_causal, False, _alibi),
    "softcap": (_causal, False, _softcap),
    "document-softcap": (_document, True, _softcap),
    "full": (None, False, None),
}


def reference_visible(case: str) -> Tensor:
    """(B, 1, N, N) bool, cell by cell from the documented rules."""
    visible = torch.zeros(BATCH, 1, SEQ, SEQ, dtype=torch.bool)
    for b in range(BATCH):
        for i in range(SEQ):
            for j in range(SEQ):
                if case == "full":
                    visible[b, 0, i, j] = True
                elif case == "window":
                    visible[b, 0, i, j] = i - WINDOW < j <= i
                elif case.startswith("document"):
                    visible[b, 0, i, j] = j <= i and bool(DOCUMENTS[b, i] == DOCUMENTS[b, j])
                else:
                    visible[b, 0, i, j] = j <= i
    return visible


def reference_scores(case: str, q: Tensor, k: Tensor) -> Tensor:
    """(B, H, N, N) float64 logits with the documented modification."""
    scores = reference.scores_from_qk(q, k)
    if case == "alibi":
        distance = torch.arange(SEQ, dtype=torch.float64)[None, :] - torch.arange(SEQ, dtype=torch.float64)[:, None]
        scores = scores + SLOPES.double()[None, :, None, None] * distance
    if case.endswith("softcap"):
        scores = CAP * torch.tanh(scores / CAP)
    return scores


def run(case: str, model: FlexLM, ids: Tensor, capture: AttentionCapture | None = None):
    mask_mod, per_batch, score_mod = CASES[case]
    block_mask = None
    if mask_mod is not None:
        batch = BATCH if per_batch else None
        block_mask = flex.create_block_mask(mask_mod, batch, None, SEQ, SEQ, device="cpu", BLOCK_SIZE=BLOCK)
    if capture is None:
        return model(ids, block_mask, score_mod)
    with capture.recording():
        return model(ids, block_mask, score_mod)


@pytest.mark.parametrize("case", list(CASES))
def test_flex_model_matches_reference(case: str) -> None:
    model = FlexLM().eval()
    ids = torch.randint(0, 50, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    inputs: dict[str, Tensor] = {}
    hooks = [
        layer.register_forward_pre_hook(lambda module, args, i=i: inputs.__setitem__(f"layers.{i}", args[0]))
        for i, layer in enumerate(model.layers)
    ]
    with torch.no_grad(), AttentionCapture(model) as capture:
        monitored = run(case, model, ids, capture)
        plain = run(case, model, ids)
    for hook in hooks:
        hook.remove()
    assert torch.equal(monitored, plain)
    summary = capture.metric.compute()
    assert sorted(summary.layers) == sorted(inputs)
    visible = reference_visible(case)
    for name, x in inputs.items():
        layer = model.get_submodule(name)
        x64 = x.double()
        q = (x64 @ layer.q_proj.weight.double().T).view(BATCH, SEQ, HEADS, -1).transpose(1, 2)
        k = (x64 @ layer.k_proj.weight.double().T).view(BATCH, SEQ, KV_HEADS, -1).transpose(1, 2)
        scores = reference_scores(case, q, k).masked_fill(~visible, -math.inf)
        probs = scores.softmax(-1)
        mean, count = reference.head_means(probs, visible, torch.ones(BATCH, SEQ, dtype=torch.bool))
        assert float(mean.max() - mean.min()) > SPREAD, f"reference heads of {name} barely differ: {mean.tolist()}"
        index = summary.layer_index(name)
        assert summary.count[index, :HEADS].tolist() == count.tolist()
        torch.testing.assert_close(summary.mean[index, :HEADS], mean, atol=TOL, rtol=0)


def test_block_mask_support_counts_keys_exactly() -> None:
    """Valid-key counts of a document + window block mask, against cell-by-cell counting."""

    def both(b, h, q_idx, kv_idx):
        return _document(b, h, q_idx, kv_idx) & (q_idx - kv_idx < WINDOW)

    block_mask = flex.create_block_mask(both, BATCH, None, SEQ, SEQ, device="cpu", BLOCK_SIZE=BLOCK)
    support = block_mask_support(block_mask.as_tuple(), BATCH, HEADS, SEQ, SEQ)
    expected = reference_visible("document") & reference_visible("window")
    assert support.num_valid().tolist() == reference.num_valid(expected).tolist()


def test_block_mask_support_follows_blocks_not_only_mask_mod() -> None:
    """A block the block mask leaves out is hidden even where mask_mod says True (the kernel skips it)."""
    block_mask = flex.create_block_mask(_causal, None, None, SEQ, SEQ, device="cpu", BLOCK_SIZE=BLOCK)
    # Keep only the diagonal blocks, with the same (causal) mask_mod.
    blocks = SEQ // BLOCK + 1
    diagonal = flex.BlockMask.from_kv_blocks(
        torch.ones(1, 1, blocks, dtype=torch.int32),
        # Row i lists block i first; only the first entry counts.
        (torch.arange(blocks)[:, None] + torch.arange(blocks)[None, :]).remainder(blocks).int()[None, None],
        BLOCK_SIZE=BLOCK,
        mask_mod=_causal,
        seq_lengths=(SEQ, SEQ),
    )
    full = block_mask_support(block_mask.as_tuple(), 1, 1, SEQ, SEQ).num_valid()
    counts = block_mask_support(diagonal.as_tuple(), 1, 1, SEQ, SEQ).num_valid()
    rows = torch.arange(SEQ)
    assert full.flatten().tolist() == (rows + 1).tolist()
    assert counts.flatten().tolist() == (rows % BLOCK + 1).tolist()


def test_sink_mass_sees_the_score_mod() -> None:
    """Mass diagnostics take the same modified logits: sink mass of an ALiBi call against the reference."""
    model = FlexLM().eval()
    ids = torch.randint(0, 50, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))
    diagnostics = MassDiagnostics(sink_tokens=1)
    inputs: dict[str, Tensor] = {}
    hook = model.layers[0].register_forward_pre_hook(lambda module, args: inputs.__setitem__("x", args[0]))
    with torch.no_grad(), AttentionCapture(model, layers=["layers.0"]) as capture:
        block_mask = flex.create_block_mask(_causal, None, None, SEQ, SEQ, device="cpu", BLOCK_SIZE=BLOCK)
        with capture.recording(consumers=[diagnostics]):
            model(ids, block_mask, _alibi)
    hook.remove()
    layer, x64 = model.layers[0], inputs["x"].double()
    q = (x64 @ layer.q_proj.weight.double().T).view(BATCH, SEQ, HEADS, -1).transpose(1, 2)
    k = (x64 @ layer.k_proj.weight.double().T).view(BATCH, SEQ, KV_HEADS, -1).transpose(1, 2)
    probs = reference_scores("alibi", q, k).masked_fill(~reference_visible("causal"), -math.inf).softmax(-1)
    expected = probs[..., 0].mean()
    summary = diagnostics.metric.compute()
    torch.testing.assert_close(
        torch.tensor(summary.to_dict()["attn_sink_mass/layers.0/mean"], dtype=torch.float64),
        expected,
        atol=TOL,
        rtol=0,
    )


def test_block_mask_support_per_head_and_batch_masks() -> None:
    """A mask that differs across heads only from row 30 on, and across the batch: counts per head, exactly.

    A small memory budget evaluates it in blocks of rows, so the support
    first agrees across heads and must widen to per-head later.
    """

    def late_heads(b, h, q_idx, kv_idx):
        window = torch.where(q_idx >= 30, 3 + 4 * h, 64)
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window) & (kv_idx >= b)

    block_mask = flex.create_block_mask(late_heads, BATCH, HEADS, SEQ, SEQ, device="cpu", BLOCK_SIZE=BLOCK)
    support = block_mask_support(block_mask.as_tuple(), BATCH, HEADS, SEQ, SEQ, memory_budget=4 * BATCH * HEADS * SEQ)
    expected = torch.zeros(BATCH, HEADS, SEQ, SEQ, dtype=torch.bool)
    for b in range(BATCH):
        for h in range(HEADS):
            for i in range(SEQ):
                for j in range(SEQ):
                    window = 3 + 4 * h if i >= 30 else 64
                    expected[b, h, i, j] = j <= i and i - j < window and j >= b
    assert support.num_valid().expand(BATCH, HEADS, SEQ).tolist() == reference.num_valid(expected).tolist()


@pytest.mark.parametrize("case", ["alibi", "softcap", "document-softcap"])
def test_max_logit_and_distance_read_the_modified_logits(case: str) -> None:
    """Every statistic is of the logits the softmax receives: the ``score_mod`` included.

    Per head, the max logit and the mean attention distance of a flex call
    with an ALiBi or soft-capping ``score_mod`` against the float64 reference
    written from the documented modification; reading the plain
    ``scale * q k^T`` instead (the statistics before they honoured
    ``score_mod``) fails here: soft-capped logits stay below the cap.
    """
    model = FlexLM().eval()
    ids = torch.randint(0, 50, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    update = StatisticsUpdate()
    inputs: dict[str, Tensor] = {}
    hook = model.layers[0].register_forward_pre_hook(lambda module, args: inputs.__setitem__("x", args[0]))
    mask_mod, per_batch, score_mod = CASES[case]
    batch = BATCH if per_batch else None
    block_mask = flex.create_block_mask(mask_mod, batch, None, SEQ, SEQ, device="cpu", BLOCK_SIZE=BLOCK)
    with torch.no_grad(), AttentionCapture(model, layers=["layers.0"]) as cap, cap.recording(consumers=[update]):
        model(ids, block_mask, score_mod)
    hook.remove()
    layer, x64 = model.layers[0], inputs["x"].double()
    q = (x64 @ layer.q_proj.weight.double().T).view(BATCH, SEQ, HEADS, -1).transpose(1, 2)
    k = (x64 @ layer.k_proj.weight.double().T).view(BATCH, SEQ, KV_HEADS, -1).transpose(1, 2)
    visible = reference_visible(case)
    scores = reference_scores(case, q, k).masked_fill(~visible, -math.inf)
    expected_max = scores.amax(dim=(0, 2, 3))
    positions = torch.arange(SEQ, dtype=torch.float64)
    offsets = (positions[:, None] - positions[None, :]).abs()

    def head_distance(logits: Tensor) -> Tensor:
        return (logits.softmax(-1) * offsets).sum(-1).mean(dim=(0, 2))

    expected_distance = head_distance(scores)
    plain = reference.scores_from_qk(q, k).masked_fill(~visible, -math.inf)
    # The modification moves both statistics far beyond the tolerance: reading plain logits cannot pass.
    assert float((head_distance(plain) - expected_distance).abs().max()) > 0.05
    assert float((plain.amax(dim=(0, 2, 3)) - expected_max).abs().max()) > 0.05
    summary = update.metric.compute()
    torch.testing.assert_close(summary.max_logit[0, :HEADS].double(), expected_max, atol=TOL, rtol=0)
    torch.testing.assert_close(summary.distance[0, :HEADS].double(), expected_distance, atol=1e-3, rtol=0)
    if case.endswith("softcap"):
        assert float(summary.max_logit.max()) < CAP
