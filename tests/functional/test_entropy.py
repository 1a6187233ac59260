"""attn_monitor.functional.entropy against the float64 reference in tests/reference.py."""

from __future__ import annotations

import math
import zlib
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attn_monitor import functional
from attn_monitor.functional.entropy import attention_lse, entropy_from_qk
from attn_monitor.functional.histograms import histogram_quantile
from attn_monitor.functional.masks import Support
from attn_monitor.functional.probs import attention_entropy, entropy_from_logits, normalize_entropy, restrict_to_support
from attn_monitor.functional.statistics import attention_distance, attention_max_logit
from tests.helpers import reference as ref

# A fused-kernel failure falls back with a warning; here it must fail the test instead.
pytestmark = pytest.mark.filterwarnings("error")

FP32_TOL = 1e-5
LOW_PRECISION_TOL = {torch.bfloat16: 2e-3, torch.float16: 2e-3}

# (batch, heads, Nq, Nk, head_dim)
SHAPES = {
    "b1h1n1": (1, 1, 1, 1, 4),
    "b2h3n7": (2, 3, 7, 7, 8),
    "b2h2q4k9": (2, 2, 4, 9, 4),
    "b1h2q9k4": (1, 2, 9, 4, 4),
}

CASES = [
    pytest.param(family, shape, id=f"{family}-{shape}")
    for family, needs_square in ref.FAMILIES.items()
    for shape, (_, _, num_q, num_k, _) in SHAPES.items()
    if num_q == num_k or not needs_square
]

# Families whose whole mask is an explicit tensor plus (optionally) causal order,
# so they can also be passed the SDPA way: `mask=explicit, is_causal=causal`.
FLAG_FAMILIES = {"none", "causal", "explicit", "explicit_causal", "one_valid", "fully_masked"}

METHODS = ["fused", "chunked", "auto"]
LOW_PRECISION = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]


# --------------------------------------------------------------------------- helpers


def generator(*parts: object) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32("/".join(map(str, parts)).encode()))


def spec_for(family: str, shape: str, heads: int | None = None) -> ref.MaskSpec:
    batch, num_heads, num_q, num_k, _ = SHAPES[shape]
    seed = zlib.crc32(f"{family}/{shape}/{heads}".encode())
    return ref.make_spec(family, batch, heads or num_heads, num_q, num_k, seed=seed)


def to_support(spec: ref.MaskSpec) -> Support:
    padding = None if spec.padding is None else torch.tensor(spec.padding, dtype=torch.bool)
    documents = None if spec.documents is None else torch.tensor(spec.documents, dtype=torch.long)
    return Support(
        spec.num_queries,
        spec.num_keys,
        padding_mask=padding,
        causal=spec.causal,
        window=spec.window,
        document_ids=documents,
        mask=spec.explicit,
    )


def assert_entropy_close(got: torch.Tensor, want: torch.Tensor, atol: float = FP32_TOL) -> None:
    """Same shape, NaN in exactly the same places, finite values within ``atol``."""
    assert got.shape == want.shape
    assert got.dtype in (torch.float32, torch.float64)
    got_nan, want_nan = got.isnan(), want.isnan()
    assert torch.equal(got_nan, want_nan), (
        f"NaN at {got_nan.nonzero().tolist()}, expected at {want_nan.nonzero().tolist()}"
    )
    assert torch.isfinite(got[~got_nan]).all()
    torch.testing.assert_close(got.double(), want, atol=atol, rtol=0, equal_nan=True)


def reference_pair(entropy: torch.Tensor, support: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return entropy, ref.normalize(entropy, ref.num_valid(support))


def random_attn(support: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Peaked weights on the support (some exact zeros), rows off by a random factor, junk elsewhere."""
    shape = support.shape
    weights = torch.exp(2.0 * torch.randn(shape, generator=gen, dtype=torch.float64))
    first_valid = support & (support.cumsum(-1) == 1)
    zeros = (torch.rand(shape, generator=gen) < 0.25) & ~first_valid
    weights = torch.where(zeros, 0.0, weights)
    on_support = torch.where(support, weights, 0.0)
    weights = weights / on_support.sum(-1, keepdim=True).clamp_min(1e-300)
    weights = weights * (0.5 + 1.5 * torch.rand(*shape[:-1], 1, generator=gen, dtype=torch.float64))
    junk = 0.7 * torch.rand(shape, generator=gen, dtype=torch.float64)
    return torch.where(support, weights, junk)


def random_qk(
    shape: str, gen: torch.Generator, kv_heads: int | None = None, heads: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    batch, num_heads, num_q, num_k, dim = SHAPES[shape]
    heads = heads or num_heads
    q = 1.2 * torch.randn(batch, heads, num_q, dim, generator=gen)
    k = 1.2 * torch.randn(batch, kv_heads or heads, num_k, dim, generator=gen)
    return q, k


def qk_mask_arguments(form: str, spec: ref.MaskSpec, dense: torch.Tensor) -> dict[str, object]:
    if form == "support":
        return {"mask": to_support(spec)}
    if form == "bool":
        return {"mask": dense}
    if form == "additive":
        return {"mask": torch.where(dense, 0.0, -math.inf)}
    if form == "hf_min":
        return {"mask": torch.where(dense, 0.0, torch.finfo(torch.float32).min)}
    if form == "flag":
        return {"mask": spec.explicit, "is_causal": spec.causal}
    raise KeyError(form)


# --------------------------------------------------------------------------- attention_entropy


@pytest.mark.parametrize("form", ["bool", "broadcast"])
@pytest.mark.parametrize(("family", "shape"), CASES)
def test_attention_entropy_matches_reference(family: str, shape: str, form: str) -> None:
    spec = spec_for(family, shape)
    dense = ref.dense_support(spec)
    attn = random_attn(dense, generator(family, shape)).float()
    if form == "bool":
        mask = dense
    else:
        # The smallest tensor that states the same support: None when all keys are visible.
        mask = to_support(spec).dense()
        mask = None if bool(mask.all()) else mask
    want, want_norm = reference_pair(ref.attention_entropy(attn, dense), dense)
    assert_entropy_close(attention_entropy(attn, mask), want)
    assert_entropy_close(attention_entropy(attn, mask, normalize=True), want_norm)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("family", ["none", "causal_pad_left", "documents", "explicit", "one_valid", "fully_masked"])
def test_attention_entropy_low_precision(family: str, dtype: torch.dtype) -> None:
    spec = spec_for(family, "b2h3n7")
    dense = ref.dense_support(spec)
    attn = random_attn(dense, generator(family, dtype)).to(dtype)
    want, want_norm = reference_pair(ref.attention_entropy(attn, dense), dense)  # same rounded inputs
    got = attention_entropy(attn, dense)
    assert got.dtype == torch.float32
    assert_entropy_close(got, want, LOW_PRECISION_TOL[dtype])
    assert_entropy_close(attention_entropy(attn, dense, normalize=True), want_norm, LOW_PRECISION_TOL[dtype])


def test_attention_entropy_ignores_masked_values_entirely() -> None:
    dense = ref.dense_support(spec_for("explicit_causal", "b2h3n7"))
    attn = random_attn(dense, generator("junk")).float()
    other = torch.where(dense, attn, 5.0 * torch.rand(attn.shape, generator=generator("junk2")))
    torch.testing.assert_close(attention_entropy(attn, dense), attention_entropy(other, dense), equal_nan=True)


def test_attention_entropy_renormalises_over_the_support() -> None:
    # Row 0: [0.2, 0.2 | 0.6 masked] -> uniform over 2 keys; row 1: [0.1, 0.3, 0.3 | 0.3 masked].
    attn = torch.tensor([[[[0.2, 0.2, 0.6, 0.0], [0.1, 0.3, 0.3, 0.3]]]])
    mask = torch.tensor([[[[True, True, False, False], [True, True, True, False]]]])
    got = attention_entropy(attn, mask)
    p = torch.tensor([1 / 7, 3 / 7, 3 / 7], dtype=torch.float64)
    want = torch.tensor([[[math.log(2), float(-(p * p.log()).sum())]]], dtype=torch.float64)
    assert_entropy_close(got, want)


# --------------------------------------------------------------------------- entropy_from_logits


@pytest.mark.parametrize("form", ["bool", "minus_inf"])
@pytest.mark.parametrize(("family", "shape"), CASES)
def test_entropy_from_logits_matches_reference(family: str, shape: str, form: str) -> None:
    spec = spec_for(family, shape)
    dense = ref.dense_support(spec)
    gen = generator("logits", family, shape)
    scores = 2.0 * torch.randn(dense.shape, generator=gen)
    if form == "bool":
        scores = torch.where(dense, scores, 50.0 * torch.randn(dense.shape, generator=gen))  # junk must be ignored
        mask = dense
    else:
        scores = scores.masked_fill(~dense, -math.inf)
        mask = None
    want, want_norm = reference_pair(ref.entropy_from_scores(scores, dense), dense)
    assert_entropy_close(entropy_from_logits(scores, mask), want)
    assert_entropy_close(entropy_from_logits(scores, mask, normalize=True), want_norm)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("family", ["none", "causal_pad_left", "window", "explicit", "fully_masked"])
def test_entropy_from_logits_low_precision(family: str, dtype: torch.dtype) -> None:
    dense = ref.dense_support(spec_for(family, "b2h3n7"))
    scores = (3.0 * torch.randn(dense.shape, generator=generator("lp", family))).to(dtype)
    want, want_norm = reference_pair(ref.entropy_from_scores(scores, dense), dense)
    got = entropy_from_logits(scores, dense)
    assert got.dtype == torch.float32
    assert_entropy_close(got, want, LOW_PRECISION_TOL[dtype])
    assert_entropy_close(entropy_from_logits(scores, dense, normalize=True), want_norm, LOW_PRECISION_TOL[dtype])


def test_entropy_from_logits_is_shift_invariant() -> None:
    scores = 4.0 * torch.randn(2, 2, 5, 6, generator=generator("shift"), dtype=torch.float64)
    base = entropy_from_logits(scores)
    assert base.dtype == torch.float64
    torch.testing.assert_close(entropy_from_logits(scores + 1e3), base, atol=1e-9, rtol=0)


@pytest.mark.parametrize("offset", [0.0, 1e3])
def test_large_logits_keep_float32_accuracy(offset: float) -> None:
    # Attention logits of order 1e3 occur (logit growth). The inputs are exact float32 values
    # and the reference uses those same values, so all error is the function's own.
    scores = 4.0 * torch.randn(2, 2, 5, 6, generator=generator("large"), dtype=torch.float64)
    shifted = (scores + offset).float()
    want = ref.entropy_from_scores(shifted, torch.ones(shifted.shape, dtype=torch.bool))
    assert_entropy_close(entropy_from_logits(shifted), want)


# --------------------------------------------------------------------------- entropy_from_qk


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("form", ["support", "bool"])
@pytest.mark.parametrize(("family", "shape"), CASES)
def test_entropy_from_qk_matches_reference(family: str, shape: str, form: str, method: str) -> None:
    spec = spec_for(family, shape)
    dense = ref.dense_support(spec)
    q, k = random_qk(shape, generator("qk", family, shape))
    want, want_norm = reference_pair(ref.entropy_from_qk(q, k, dense), dense)
    kwargs = qk_mask_arguments(form, spec, dense)
    got = entropy_from_qk(q, k, method=method, **kwargs)
    assert got.dtype == torch.float32
    assert_entropy_close(got, want)
    assert_entropy_close(entropy_from_qk(q, k, method=method, normalize=True, **kwargs), want_norm)


MASK_FORM_CASES = [
    pytest.param(family, shape, form, id=f"{family}-{shape}-{form}")
    for family, shape in (case.values for case in CASES)
    for form in ("additive", "hf_min", "flag")
    if form != "flag" or family in FLAG_FAMILIES
]


@pytest.mark.parametrize(("family", "shape", "form"), MASK_FORM_CASES)
def test_entropy_from_qk_sdpa_mask_forms(family: str, shape: str, form: str) -> None:
    """Float masks without bias (-inf or the dtype minimum) and `is_causal` take the fused path exactly."""
    spec = spec_for(family, shape)
    dense = ref.dense_support(spec)
    q, k = random_qk(shape, generator("forms", family, shape))
    want, want_norm = reference_pair(ref.entropy_from_qk(q, k, dense), dense)
    kwargs = qk_mask_arguments(form, spec, dense)
    assert_entropy_close(entropy_from_qk(q, k, method="fused", **kwargs), want)
    assert_entropy_close(entropy_from_qk(q, k, normalize=True, **kwargs), want_norm)


@pytest.mark.parametrize("method", ["fused", "chunked"])
@pytest.mark.parametrize("kv_heads", [1, 2])
@pytest.mark.parametrize("form", ["support", "bool"])
@pytest.mark.parametrize("family", list(ref.FAMILIES))
def test_grouped_query_attention(family: str, form: str, kv_heads: int, method: str) -> None:
    spec = spec_for(family, "b2h3n7", heads=4)
    dense = ref.dense_support(spec)
    q, k = random_qk("b2h3n7", generator("gqa", family, kv_heads), kv_heads=kv_heads, heads=4)
    assert k.shape[1] == kv_heads < q.shape[1] == 4
    want, want_norm = reference_pair(ref.entropy_from_qk(q, k, dense), dense)
    kwargs = qk_mask_arguments(form, spec, dense)
    assert_entropy_close(entropy_from_qk(q, k, method=method, **kwargs), want)
    assert_entropy_close(entropy_from_qk(q, k, method=method, normalize=True, **kwargs), want_norm)


def test_grouped_query_attention_uses_contiguous_head_groups() -> None:
    # heads 0, 1 share key head 0; heads 2, 3 share key head 1 (not 0, 2 / 1, 3).
    q = torch.randn(1, 4, 5, 8, generator=generator("groups"))
    k = torch.randn(1, 2, 5, 8, generator=generator("groups-k"))
    expanded = k.repeat_interleave(2, dim=1)
    for method in ("fused", "chunked"):
        torch.testing.assert_close(
            entropy_from_qk(q, k, method=method), entropy_from_qk(q, expanded, method="chunked"), atol=1e-5, rtol=0
        )


BUDGET_CASES = [
    pytest.param(family, shape, id=f"{family}-{shape}")
    for family in ("none", "causal", "causal_pad_left", "window", "window_pad_causal", "window_documents", "explicit")
    for shape in ("b2h3n7", "b1h2q9k4", "b2h2q4k9")
    if SHAPES[shape][2] == SHAPES[shape][3] or not ref.FAMILIES[family]
]


@pytest.mark.parametrize("memory_budget", [1, 100, 700, 10**9])
@pytest.mark.parametrize(("family", "shape"), BUDGET_CASES)
def test_chunked_blocks_match_reference(family: str, shape: str, memory_budget: int) -> None:
    spec = spec_for(family, shape)
    dense = ref.dense_support(spec)
    q, k = random_qk(shape, generator("budget", family, shape))
    want = ref.entropy_from_qk(q, k, dense)
    got = entropy_from_qk(q, k, mask=to_support(spec), method="chunked", memory_budget=memory_budget)
    assert_entropy_close(got, want)


@pytest.mark.parametrize("scale", [None, 0.3, 2.0, 0.0, -0.5])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("family", ["causal_pad_right", "explicit"])
def test_custom_scale(family: str, scale: float | None, method: str) -> None:
    spec = spec_for(family, "b2h3n7")
    dense = ref.dense_support(spec)
    q, k = random_qk("b2h3n7", generator("scale"))
    want = ref.entropy_from_qk(q, k, dense, scale=scale)
    assert_entropy_close(entropy_from_qk(q, k, mask=to_support(spec), scale=scale, method=method), want)


@pytest.mark.parametrize("method", ["fused", "chunked"])
@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("family", ["none", "causal_pad_left", "documents_causal", "window", "explicit", "one_valid"])
def test_entropy_from_qk_low_precision(family: str, dtype: torch.dtype, method: str) -> None:
    spec = spec_for(family, "b2h3n7")
    dense = ref.dense_support(spec)
    q, k = random_qk("b2h3n7", generator("lp-qk", family))
    q, k = q.to(dtype), k.to(dtype)
    want, want_norm = reference_pair(ref.entropy_from_qk(q, k, dense), dense)  # from the rounded inputs
    got = entropy_from_qk(q, k, mask=to_support(spec), method=method)
    assert got.dtype == torch.float32
    assert_entropy_close(got, want, LOW_PRECISION_TOL[dtype])
    got_norm = entropy_from_qk(q, k, mask=to_support(spec), method=method, normalize=True)
    assert_entropy_close(got_norm, want_norm, LOW_PRECISION_TOL[dtype])


@pytest.mark.parametrize("method", METHODS)
def test_float64_inputs_stay_float64(method: str) -> None:
    q, k = random_qk("b2h3n7", generator("f64"))
    q, k = q.double(), k.double()
    dense = torch.ones(1, 1, 7, 7, dtype=torch.bool).tril()
    got = entropy_from_qk(q, k, is_causal=True, method=method)
    assert got.dtype == torch.float64
    assert_entropy_close(got, ref.entropy_from_qk(q, k, dense), atol=1e-9)
    assert attention_entropy(torch.full((1, 1, 2, 4), 0.25, dtype=torch.float64)).dtype == torch.float64
    assert entropy_from_logits(torch.zeros(1, 1, 2, 4, dtype=torch.float64)).dtype == torch.float64


@pytest.mark.parametrize(("family", "shape"), [c for c in CASES if c.values[1] != "b1h1n1"])
def test_auto_takes_the_fused_path_without_bias(family: str, shape: str) -> None:
    spec = spec_for(family, shape)
    q, k = random_qk(shape, generator("auto", family, shape))
    support = to_support(spec)
    auto = entropy_from_qk(q, k, mask=support, method="auto")
    torch.testing.assert_close(
        auto, entropy_from_qk(q, k, mask=support, method="fused"), atol=0, rtol=0, equal_nan=True
    )


# --------------------------------------------------------------------------- additive biases (ALiBi-like)


def alibi(heads: int, num_q: int, num_k: int) -> torch.Tensor:
    """(1, heads, Nq, Nk) finite linear distance bias with per-head slopes."""
    slopes = torch.tensor([2.0 ** -(h + 1) for h in range(heads)])
    distance = (torch.arange(num_q)[:, None] - torch.arange(num_k)[None, :]).abs().float()
    return (-slopes[:, None, None] * distance)[None]


@pytest.mark.parametrize("shape", ["b2h3n7", "b2h2q4k9", "b1h2q9k4"])
def test_alibi_causal_float_mask(shape: str) -> None:
    batch, heads, num_q, num_k, _ = SHAPES[shape]
    bias = alibi(heads, num_q, num_k)
    visible = torch.ones(num_q, num_k, dtype=torch.bool).tril()
    mask = torch.where(visible, bias, -math.inf)
    q, k = random_qk(shape, generator("alibi", shape))
    dense = visible.expand(batch, heads, num_q, num_k)
    want, want_norm = reference_pair(ref.entropy_from_qk(q, k, dense, bias=mask), dense)
    # The bias changes the distribution: the bias-free entropy must differ.
    assert not torch.allclose(ref.entropy_from_qk(q, k, dense).nan_to_num(), want.nan_to_num(), atol=1e-3)
    with pytest.raises(ValueError, match="fused"):
        entropy_from_qk(q, k, mask=mask, method="fused")
    chunked = entropy_from_qk(q, k, mask=mask, method="chunked")
    assert_entropy_close(chunked, want)
    auto = entropy_from_qk(q, k, mask=mask, method="auto")
    torch.testing.assert_close(auto, chunked, atol=0, rtol=0, equal_nan=True)
    assert_entropy_close(entropy_from_qk(q, k, mask=mask, normalize=True), want_norm)
    assert_entropy_close(entropy_from_qk(q, k, mask=mask, method="chunked", memory_budget=1), want)


@pytest.mark.parametrize("kv_heads", [None, 1])
def test_bias_inside_support_with_padding(kv_heads: int | None) -> None:
    spec = spec_for("causal_pad_left", "b2h3n7")
    bias = alibi(3, 7, 7)
    support = Support(7, padding_mask=torch.tensor(spec.padding), causal=True, mask=bias)
    assert support.bias is not None
    dense = ref.dense_support(spec)
    q, k = random_qk("b2h3n7", generator("bias-pad"), kv_heads=kv_heads)
    want = ref.entropy_from_qk(q, k, dense, bias=bias)
    with pytest.raises(ValueError, match="fused"):
        entropy_from_qk(q, k, mask=support, method="fused")
    assert_entropy_close(entropy_from_qk(q, k, mask=support), want)
    assert_entropy_close(entropy_from_qk(q, k, mask=support, method="chunked", memory_budget=1), want)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_random_relative_bias_low_precision(dtype: torch.dtype) -> None:
    gen = generator("relbias", dtype)
    bias = torch.randn(2, 2, 4, 9, generator=gen).to(dtype)
    q, k = random_qk("b2h2q4k9", gen)
    q, k = q.to(dtype), k.to(dtype)
    dense = torch.ones(4, 9, dtype=torch.bool).tril().expand(2, 2, 4, 9)
    want = ref.entropy_from_qk(q, k, dense, bias=bias)
    assert_entropy_close(entropy_from_qk(q, k, mask=bias, is_causal=True), want, LOW_PRECISION_TOL[dtype])


# --------------------------------------------------------------------------- NaN rules


@pytest.mark.parametrize("method", ["fused", "chunked"])
@pytest.mark.parametrize(("family", "shape"), CASES)
def test_nan_exactly_where_the_rules_say(family: str, shape: str, method: str) -> None:
    spec = spec_for(family, shape)
    counts = ref.num_valid(ref.dense_support(spec))
    q, k = random_qk(shape, generator("nan", family, shape))
    support = to_support(spec)
    raw = entropy_from_qk(q, k, mask=support, method=method)
    normed = entropy_from_qk(q, k, mask=support, method=method, normalize=True)
    assert torch.equal(raw.isnan(), counts == 0)
    assert torch.equal(normed.isnan(), counts <= 1)
    assert (raw[counts == 1] == 0).all()
    assert not torch.signbit(raw[counts >= 1]).any()  # no -0.0 either


def test_normalize_entropy_matches_reference() -> None:
    counts = torch.tensor([0, 1, 2, 3, 7, 100])
    entropy = torch.tensor([0.0, 0.0, math.log(2) / 2, math.log(3), 1.0, 2.5])
    want = ref.normalize(entropy.double(), counts)
    assert_entropy_close(normalize_entropy(entropy, counts), want)
    assert_entropy_close(normalize_entropy(entropy[:, None], counts[None, :]).diagonal(), want)


# --------------------------------------------------------------------------- properties


@st.composite
def masked_problem(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Generator, int]:
    batch, heads = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    num_q, num_k = draw(st.integers(1, 6)), draw(st.integers(1, 7))
    density = draw(st.sampled_from([0.2, 0.6, 1.0]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    mask = torch.rand(batch, heads, num_q, num_k, generator=gen) < density
    return mask, gen, draw(st.integers(0, 2**31 - 1))


PROPERTY = settings(max_examples=40, deadline=None)


@PROPERTY
@given(problem=masked_problem(), data=st.data())
def test_permuting_keys_with_the_mask_changes_nothing(problem, data: st.DataObject) -> None:
    mask, gen, _ = problem
    perm = torch.tensor(data.draw(st.permutations(range(mask.shape[-1]))), dtype=torch.long)
    attn = random_attn(mask, gen).float()
    permuted = attention_entropy(attn[..., perm], mask[..., perm])
    torch.testing.assert_close(permuted, attention_entropy(attn, mask), atol=5e-6, rtol=0, equal_nan=True)
    scores = 3.0 * torch.randn(mask.shape, generator=gen)
    torch.testing.assert_close(
        entropy_from_logits(scores[..., perm], mask[..., perm]),
        entropy_from_logits(scores, mask),
        atol=1e-6,
        rtol=0,
        equal_nan=True,
    )
    batch, heads, num_q, num_k = mask.shape
    q, k = torch.randn(batch, heads, num_q, 4, generator=gen), torch.randn(batch, heads, num_k, 4, generator=gen)
    for method in ("fused", "chunked"):
        torch.testing.assert_close(
            entropy_from_qk(q, k[:, :, perm], mask=mask[..., perm], method=method),
            entropy_from_qk(q, k, mask=mask, method=method),
            atol=1e-5,
            rtol=0,
            equal_nan=True,
        )


@PROPERTY
@given(problem=masked_problem())
def test_uniform_over_valid_keys_is_one(problem) -> None:
    mask, gen, _ = problem
    counts = mask.sum(-1)
    attn = torch.where(mask, 1.0 / counts.clamp(min=1)[..., None], torch.rand(mask.shape, generator=gen))
    expect_norm = torch.where(counts > 1, 1.0, math.nan)
    expect_raw = torch.where(counts > 0, counts.double().log(), math.nan)
    close = {"atol": 1e-6, "rtol": 0, "equal_nan": True}
    torch.testing.assert_close(attention_entropy(attn, mask, normalize=True).double(), expect_norm.double(), **close)
    torch.testing.assert_close(attention_entropy(attn, mask).double(), expect_raw, **close)
    logits = torch.where(mask, 0.7, torch.randn(mask.shape, generator=gen))
    torch.testing.assert_close(entropy_from_logits(logits, mask).double(), expect_raw, **close)
    batch, heads, num_q, num_k = mask.shape
    q, k = torch.zeros(batch, heads, num_q, 4), torch.randn(batch, heads, num_k, 4, generator=gen)
    for method in ("fused", "chunked"):
        got = entropy_from_qk(q, k, mask=mask, method=method, normalize=True)
        torch.testing.assert_close(got.double(), expect_norm.double(), atol=5e-6, rtol=0, equal_nan=True)


@PROPERTY
@given(problem=masked_problem())
def test_one_hot_is_zero(problem) -> None:
    mask, gen, _ = problem
    counts = mask.sum(-1)
    noise = torch.rand(mask.shape, generator=gen)
    chosen = torch.where(mask, noise, -1.0).argmax(-1, keepdim=True)
    attn = torch.zeros(mask.shape).scatter(-1, chosen, 1.0)
    attn = torch.where(mask, attn, noise)  # junk outside the support
    expect_raw = torch.where(counts > 0, 0.0, math.nan)
    expect_norm = torch.where(counts > 1, 0.0, math.nan)
    torch.testing.assert_close(attention_entropy(attn, mask), expect_raw, equal_nan=True)
    torch.testing.assert_close(attention_entropy(attn, mask, normalize=True), expect_norm, equal_nan=True)
    # A 200-nat gap makes every other key's weight vanish in float32.
    logits = torch.where(attn > 0.5, 100.0, -100.0)
    torch.testing.assert_close(entropy_from_logits(logits, mask), expect_raw, equal_nan=True)


@PROPERTY
@given(problem=masked_problem(), magnitude=st.sampled_from([0.01, 1.0, 10.0, 60.0]))
def test_bounds(problem, magnitude: float) -> None:
    mask, gen, _ = problem
    counts = mask.sum(-1)
    has_keys, has_choice = counts > 0, counts > 1
    upper = counts.clamp(min=1).double().log()
    batch, heads, num_q, num_k = mask.shape
    q = magnitude * torch.randn(batch, heads, num_q, 8, generator=gen)
    k = torch.randn(batch, heads, num_k, 8, generator=gen)
    results = [entropy_from_logits(magnitude * torch.randn(mask.shape, generator=gen), mask)]
    results += [entropy_from_qk(q, k, mask=mask, method=method) for method in ("fused", "chunked")]
    logits = (magnitude * torch.randn(mask.shape, generator=gen, dtype=torch.float64)).masked_fill(~mask, -math.inf)
    weights = logits.softmax(-1).nan_to_num(0.0)  # rows without keys: all zero
    results.append(attention_entropy(weights.float(), mask))
    for entropy in results:
        assert torch.equal(entropy.isnan(), ~has_keys)
        assert (entropy[has_keys] >= 0).all()
        assert (entropy[has_keys].double() <= upper[has_keys] + 1e-6).all()
    normed = entropy_from_qk(q, k, mask=mask, normalize=True)
    assert torch.equal(normed.isnan(), ~has_choice)
    assert ((normed[has_choice] >= 0) & (normed[has_choice] <= 1)).all()


@st.composite
def structured_problem(draw: st.DrawFn) -> tuple[ref.MaskSpec, torch.Tensor, torch.Tensor]:
    batch, heads = draw(st.integers(1, 2)), draw(st.integers(1, 4))
    kv_heads = draw(st.sampled_from([h for h in range(1, heads + 1) if heads % h == 0]))
    num_q = draw(st.integers(1, 9))
    num_k = draw(st.one_of(st.just(num_q), st.integers(1, 9)))
    spec = ref.MaskSpec(batch, heads, num_q, num_k)
    if draw(st.booleans()):
        lengths = [draw(st.integers(0, num_k)) for _ in range(batch)]
        left = draw(st.booleans())
        spec.padding = [
            ([False] * (num_k - n) + [True] * n) if left else ([True] * n + [False] * (num_k - n)) for n in lengths
        ]
    spec.causal = draw(st.booleans())
    if spec.causal and draw(st.booleans()):
        spec.window = draw(st.integers(1, 6))
    if num_q == num_k and draw(st.booleans()):
        cuts = sorted(draw(st.sets(st.integers(1, max(1, num_k - 1)), max_size=3)))
        spec.documents = [[sum(i >= c for c in cuts) for i in range(num_k)]] * batch
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    if draw(st.booleans()):
        spec.explicit = torch.rand(1, heads, num_q, num_k, generator=gen) < 0.7
    scale = draw(st.sampled_from([0.5, 1.0, 2.0]))
    q = scale * torch.randn(batch, heads, num_q, 8, generator=gen)
    k = torch.randn(batch, kv_heads, num_k, 8, generator=gen)
    return spec, q, k


@settings(max_examples=60, deadline=None)
@given(problem=structured_problem(), normalize=st.booleans())
def test_fused_equals_chunked(problem, normalize: bool) -> None:
    spec, q, k = problem
    support = to_support(spec)
    fused = entropy_from_qk(q, k, mask=support, method="fused", normalize=normalize)
    chunked = entropy_from_qk(q, k, mask=support, method="chunked", normalize=normalize, memory_budget=512)
    assert torch.equal(fused.isnan(), chunked.isnan())
    torch.testing.assert_close(fused, chunked, atol=1e-5, rtol=0, equal_nan=True)
    dense = ref.dense_support(spec)
    want = ref.entropy_from_qk(q, k, dense)
    assert_entropy_close(fused, ref.normalize(want, ref.num_valid(dense)) if normalize else want)


# --------------------------------------------------------------------------- bad input


GOOD_ATTN = torch.full((2, 3, 4, 5), 0.2)


@pytest.mark.parametrize(
    ("attn", "mask", "error", "match"),
    [
        pytest.param(GOOD_ATTN[0], None, ValueError, "`attn`", id="attn-3d"),
        pytest.param(GOOD_ATTN[None], None, ValueError, "`attn`", id="attn-5d"),
        pytest.param(GOOD_ATTN[:, :, :, :0], None, ValueError, "`attn`", id="attn-empty"),
        pytest.param(GOOD_ATTN.tolist(), None, TypeError, "`attn`", id="attn-list"),
        pytest.param(GOOD_ATTN.long(), None, TypeError, "`attn`", id="attn-int"),
        pytest.param(
            GOOD_ATTN.index_put((torch.tensor(0),), torch.tensor(math.nan)), None, ValueError, "`attn`", id="nan"
        ),
        pytest.param(
            GOOD_ATTN.index_put((torch.tensor(1),), torch.tensor(math.inf)), None, ValueError, "`attn`", id="inf"
        ),
        pytest.param(GOOD_ATTN - 0.3, None, ValueError, "`attn`", id="negative"),
        pytest.param(torch.zeros(1, 1, 2, 3), None, ValueError, "`attn`", id="zero-mass"),
        pytest.param(GOOD_ATTN, torch.ones(2, 3, 4, 5), TypeError, "`mask`", id="mask-float"),
        pytest.param(GOOD_ATTN, torch.ones(2, 3, 4, 5, dtype=torch.long), TypeError, "`mask`", id="mask-int"),
        pytest.param(GOOD_ATTN, [[True] * 5] * 4, TypeError, "`mask`", id="mask-list"),
        pytest.param(GOOD_ATTN, torch.ones(2, 3, 4, 6, dtype=torch.bool), ValueError, "`mask`", id="mask-keys"),
        pytest.param(GOOD_ATTN, torch.ones(3, 1, 1, 5, dtype=torch.bool), ValueError, "`mask`", id="mask-batch"),
        pytest.param(GOOD_ATTN, torch.ones(2, 2, 4, 5, dtype=torch.bool), ValueError, "`mask`", id="mask-heads"),
        pytest.param(GOOD_ATTN, torch.ones(1, 2, 3, 4, 5, dtype=torch.bool), ValueError, "`mask`", id="mask-5d"),
        pytest.param(GOOD_ATTN[:1], torch.ones(2, 3, 4, 5, dtype=torch.bool), ValueError, "`mask`", id="mask-grows"),
    ],
)
def test_attention_entropy_bad_input(attn: object, mask: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        attention_entropy(attn, mask)  # type: ignore[arg-type]


def test_attention_entropy_mass_off_the_support() -> None:
    attn = torch.tensor([[[[0.0, 0.0, 1.0]]]])
    with pytest.raises(ValueError, match="`attn`"):
        attention_entropy(attn, torch.tensor([True, True, False]))


@pytest.mark.parametrize(
    ("scores", "mask", "error", "match"),
    [
        pytest.param(torch.zeros(3, 4, 5), None, ValueError, "`scores`", id="scores-3d"),
        pytest.param(torch.zeros(1, 1, 3, 4, dtype=torch.long), None, TypeError, "`scores`", id="scores-int"),
        pytest.param(torch.full((1, 1, 2, 3), math.nan), None, ValueError, "`scores`", id="nan"),
        pytest.param(torch.tensor([[[[0.0, math.inf]]]]), None, ValueError, "`scores`", id="plus-inf"),
        pytest.param(
            torch.tensor([[[[0.0, -math.inf]]]]),
            torch.tensor([True, True]),
            ValueError,
            "`mask`",
            id="visible-minus-inf",
        ),
        pytest.param(torch.zeros(1, 1, 2, 3), torch.zeros(1, 1, 2, 3), TypeError, "`mask`", id="mask-float"),
        pytest.param(
            torch.zeros(1, 1, 2, 3), torch.ones(2, 4, dtype=torch.bool), ValueError, "`mask`", id="mask-shape"
        ),
        pytest.param(
            torch.zeros(2, 1, 2, 3), torch.ones(3, 1, 2, 3, dtype=torch.bool), ValueError, "`mask`", id="mask-batch"
        ),
    ],
)
def test_entropy_from_logits_bad_input(scores: object, mask: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        entropy_from_logits(scores, mask)  # type: ignore[arg-type]


Q = torch.randn(2, 4, 5, 8)
K = torch.randn(2, 2, 6, 8)


@pytest.mark.parametrize(
    ("q", "k", "kwargs", "error", "match"),
    [
        pytest.param(Q[0], K, {}, ValueError, "`q`", id="q-3d"),
        pytest.param(Q, K[0], {}, ValueError, "`k`", id="k-3d"),
        pytest.param(Q.tolist(), K, {}, TypeError, "`q`", id="q-list"),
        pytest.param(Q, K.long(), {}, TypeError, "`k`", id="k-int"),
        pytest.param(Q, K[:1], {}, ValueError, "`k`", id="batch"),
        pytest.param(Q, K[..., :4], {}, ValueError, "`k`", id="head-dim"),
        pytest.param(Q, torch.randn(2, 3, 6, 8), {}, ValueError, "heads", id="heads-not-multiple"),
        pytest.param(Q, K, {"mask": torch.ones(3, 1, 5, 6, dtype=torch.bool)}, ValueError, "mask", id="mask-batch"),
        pytest.param(Q, K, {"mask": torch.ones(5, 7, dtype=torch.bool)}, ValueError, "`mask`", id="mask-keys"),
        pytest.param(Q, K, {"mask": torch.ones(6, 5, dtype=torch.bool)}, ValueError, "`mask`", id="mask-transposed"),
        pytest.param(Q, K, {"mask": torch.ones(1, 1, 1, 5, 6, dtype=torch.bool)}, ValueError, "`mask`", id="mask-5d"),
        pytest.param(Q, K, {"mask": torch.ones(5, 6, dtype=torch.long)}, TypeError, "`mask`", id="mask-int"),
        pytest.param(Q, K, {"mask": torch.full((5, 6), math.nan)}, ValueError, "`mask`", id="mask-nan"),
        pytest.param(Q, K, {"mask": Support(5, 7)}, ValueError, "Support", id="support-size"),
        pytest.param(
            Q,
            K,
            {"mask": Support(5, 6, padding_mask=torch.ones(3, 6, dtype=torch.bool))},
            ValueError,
            "mask",
            id="support-batch",
        ),
        pytest.param(Q, K, {"mask": Support(5, 6), "is_causal": True}, ValueError, "causal", id="support-causal"),
        pytest.param(Q, K, {"method": "flash"}, ValueError, "`method`", id="method"),
        pytest.param(Q, K, {"memory_budget": 0}, ValueError, "`memory_budget`", id="budget-zero"),
        pytest.param(Q, K, {"memory_budget": 1.5}, ValueError, "`memory_budget`", id="budget-float"),
    ],
)
def test_entropy_from_qk_bad_input(q: object, k: object, kwargs: dict, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        entropy_from_qk(q, k, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("method", METHODS)
def test_entropy_from_qk_mask_with_wrong_heads(method: str) -> None:
    # A per-head mask for 3 heads cannot apply to 4 query heads: a ValueError naming `mask`,
    # not an internal broadcasting RuntimeError (or a fallback warning first).
    mask = torch.ones(2, 3, 5, 6, dtype=torch.bool)
    with pytest.raises(ValueError, match="`mask`"):
        entropy_from_qk(Q, K, mask=mask, method=method)


@pytest.mark.parametrize("method", METHODS)
def test_entropy_from_qk_key_padding_mask_broadcasts(method: str) -> None:
    # SDPA's usual key-padding mask shape (B, 1, 1, Nk); the docstring says "broadcastable".
    padding = torch.tensor([[True] * 4 + [False] * 2, [True] * 6])
    dense = padding[:, None, None, :].expand(2, 4, 5, 6)
    want = ref.entropy_from_qk(Q, K, dense)
    assert_entropy_close(entropy_from_qk(Q, K, mask=padding[:, None, None, :], method=method), want)


# --------------------------------------------------------------------------- non-finite input

QK_FUNCTIONS = {
    "entropy_from_qk": entropy_from_qk,
    "attention_lse": attention_lse,
    "attention_max_logit": attention_max_logit,
    "attention_distance": attention_distance,
}
QS = torch.randn(2, 4, 6, 8, generator=generator("finite-q"))
KS = torch.randn(2, 2, 6, 8, generator=generator("finite-k"))
NONFINITE_CASES = {
    "q-nan": (QS.index_put((torch.tensor(1), torch.tensor(2)), torch.tensor(math.nan)), KS, {}, "`q`"),
    "q-inf": (QS.index_put((torch.tensor(0),), torch.tensor(-math.inf)), KS, {}, "`q`"),
    "k-inf": (QS, KS.index_put((torch.tensor(0), torch.tensor(1)), torch.tensor(math.inf)), {}, "`k`"),
    "k-nan": (QS, KS.index_put((torch.tensor(1),), torch.tensor(math.nan)), {}, "`k`"),
    "scale-nan": (QS, KS, {"scale": math.nan}, "`scale`"),
    "scale-inf": (QS, KS, {"scale": math.inf}, "`scale`"),
    "scale-minus-inf": (QS, KS, {"scale": -math.inf}, "`scale`"),
    "mask-plus-inf": (QS, KS, {"mask": torch.zeros(6, 6).index_fill(1, torch.tensor(3), math.inf)}, "`mask`"),
    "mask-nan": (QS, KS, {"mask": torch.zeros(1, 1, 1, 6).index_fill(-1, torch.tensor(0), math.nan)}, "`mask`"),
    "support-bias-plus-inf": (
        QS,
        KS,
        {"mask": Support(6, mask=torch.zeros(6, 6).index_fill(0, torch.tensor(5), math.inf))},
        "`mask`",
    ),
}


#: Each function with each of its paths.
FUNCTION_PATHS = [(name, {"method": method}) for name in ("entropy_from_qk", "attention_lse") for method in METHODS] + [
    ("attention_max_logit", {}),
    ("attention_distance", {}),
]


@pytest.mark.parametrize("case", list(NONFINITE_CASES))
@pytest.mark.parametrize(("function", "path"), FUNCTION_PATHS, ids=[f"{f}-{p}" for f, p in FUNCTION_PATHS])
def test_non_finite_input_raises_naming_the_argument(function: str, path: dict, case: str) -> None:
    """Each of these gave NaN for some queries; now a ValueError names the argument (every path)."""
    q, k, kwargs, name = NONFINITE_CASES[case]
    with pytest.raises(ValueError, match=name):
        QK_FUNCTIONS[function](q, k, **kwargs, **path)


def test_finite_input_whose_sum_overflows_is_accepted() -> None:
    """The finite check sums first; a sum that overflows on finite values must not read as bad input."""
    q = torch.full((1, 1, 4, 2), 3.0e38)  # every value finite, their float32 sum is inf
    k = torch.zeros(1, 1, 4, 2)  # equal logits: uniform over the visible keys
    assert not torch.isfinite(q.sum())
    want = torch.tensor([[[1.0, 2, 3, 4]]], dtype=torch.float64).log()
    assert_entropy_close(entropy_from_qk(q, k, is_causal=True), want)


@pytest.mark.parametrize("scale", [True, "0.5", torch.tensor(0.5)], ids=["bool", "str", "tensor"])
def test_scale_of_the_wrong_type_raises(scale: object) -> None:
    with pytest.raises(TypeError, match="`scale`"):
        entropy_from_qk(QS, KS, scale=scale)  # type: ignore[arg-type]


def test_minus_inf_in_an_additive_mask_still_hides_keys() -> None:
    mask = torch.zeros(6, 6).masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), -math.inf)
    want = ref.entropy_from_qk(QS, KS, torch.ones(6, 6, dtype=torch.bool).tril().expand(2, 4, 6, 6))
    assert_entropy_close(entropy_from_qk(QS, KS, mask=mask), want)


# --------------------------------------------------------------------------- restrict_to_support


def reference_weights(attn: torch.Tensor, support: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 weights renormalised over the support, row by row, and rows with no mass on a non-empty support."""
    attn64, support = attn.double(), support.expand(attn.shape)
    weights = torch.zeros_like(attn64)
    no_mass = torch.zeros(attn.shape[:-1], dtype=torch.bool)
    for index in torch.cartesian_prod(*(torch.arange(n) for n in attn.shape[:-1])).tolist():
        row, visible = attn64[tuple(index)], support[tuple(index)]
        total = math.fsum(float(w) for w, v in zip(row, visible, strict=True) if v)
        if total > 0:
            weights[tuple(index)] = torch.where(visible, row / total, 0.0)
        no_mass[tuple(index)] = total == 0 and bool(visible.any())
    return weights, no_mass


@pytest.mark.parametrize("family", ["none", "causal_pad_left", "documents", "explicit", "fully_masked"])
def test_restrict_to_support_matches_reference(family: str) -> None:
    spec = spec_for(family, "b2h3n7")
    dense = ref.dense_support(spec)
    attn = random_attn(dense, generator("restrict", family)).float()
    attn[0, 1, 2] = torch.where(dense[0, 1, 2], 0.0, attn[0, 1, 2])  # one query without mass on its support
    weights, no_mass = restrict_to_support(attn, dense)
    want_weights, want_no_mass = reference_weights(attn, dense)
    assert weights.dtype == torch.float32 and no_mass.shape == (2, 3, 7)
    torch.testing.assert_close(weights.double(), want_weights, atol=1e-6, rtol=0)
    assert torch.equal(no_mass, want_no_mass)
    assert bool(want_no_mass[0, 1, 2]) == bool(dense[0, 1, 2].any())


def test_attention_entropy_no_mass_nan_leaves_the_other_queries_exact() -> None:
    spec = spec_for("causal_pad_right", "b2h3n7")
    dense = ref.dense_support(spec)
    attn = random_attn(dense, generator("no-mass")).float()
    attn[1, 0, 3] = torch.where(dense[1, 0, 3], 0.0, attn[1, 0, 3])
    with pytest.raises(ValueError, match="zero mass"):
        attention_entropy(attn, dense)
    got = attention_entropy(attn, dense, no_mass="nan")
    refilled = attn.clone()
    refilled[1, 0, 3] = 1.0
    want = ref.attention_entropy(refilled, dense)
    want[1, 0, 3] = math.nan
    assert_entropy_close(got, want)
    with pytest.raises(ValueError, match="`no_mass`"):
        attention_entropy(attn, dense, no_mass="zero")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- max logit and distance

SQUARE_CASES = [case for case in CASES if SHAPES[case.values[1]][2] == SHAPES[case.values[1]][3]]


def assert_statistic_close(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float = 0.0) -> None:
    """NaN in the same places; finite values within ``atol + rtol * |want|``."""
    assert got.shape == want.shape and got.dtype == torch.float32
    assert torch.equal(got.isnan(), want.isnan()), (got, want)
    torch.testing.assert_close(got.double(), want, rtol=rtol, atol=atol, equal_nan=True)


@pytest.mark.parametrize("form", ["support", "bool", "additive"])
@pytest.mark.parametrize(("family", "shape"), CASES)
def test_max_logit_matches_reference(family: str, shape: str, form: str) -> None:
    spec = spec_for(family, shape)
    dense = ref.dense_support(spec)
    q, k = random_qk(shape, generator("max-logit", family, shape))
    got = attention_max_logit(q, k, **qk_mask_arguments(form, spec, dense))  # type: ignore[arg-type]
    assert_statistic_close(got, ref.max_logit_from_qk(q, k, dense), rtol=1e-5, atol=1e-6)


DISTANCE_CASES = [
    pytest.param(*case.values, form, id=f"{case.id}-{form}")
    for case in SQUARE_CASES
    for form in ("support", "bool", "flag")
    if form != "flag" or case.values[0] in FLAG_FAMILIES
]


@pytest.mark.parametrize(("family", "shape", "form"), DISTANCE_CASES)
def test_distance_matches_reference(family: str, shape: str, form: str) -> None:
    spec = spec_for(family, shape)
    dense = ref.dense_support(spec)
    q, k = random_qk(shape, generator("distance", family, shape))
    got = attention_distance(q, k, **qk_mask_arguments(form, spec, dense))  # type: ignore[arg-type]
    assert_statistic_close(got, ref.distance_from_qk(q, k, dense), rtol=0, atol=1e-5)


@pytest.mark.parametrize("kv_heads", [1, 2])
@pytest.mark.parametrize("family", ["causal_pad_left", "documents_causal", "window_pad_causal", "explicit"])
def test_max_logit_and_distance_grouped_query_attention(family: str, kv_heads: int) -> None:
    spec = spec_for(family, "b2h3n7", heads=4)
    dense = ref.dense_support(spec)
    q, k = random_qk("b2h3n7", generator("gqa-stats", family, kv_heads), kv_heads=kv_heads, heads=4)
    support = to_support(spec)
    assert_statistic_close(attention_max_logit(q, k, mask=support), ref.max_logit_from_qk(q, k, dense), 1e-5, 1e-6)
    assert_statistic_close(attention_distance(q, k, mask=support), ref.distance_from_qk(q, k, dense), 0, 1e-5)


@pytest.mark.parametrize("memory_budget", [1, 300, 10**9])
@pytest.mark.parametrize("family", ["causal", "causal_pad_left", "window_pad_causal", "window_documents", "explicit"])
def test_max_logit_and_distance_in_query_blocks(family: str, memory_budget: int) -> None:
    spec = ref.make_spec(family, 2, 2, 13, 13, seed=zlib.crc32(family.encode()))
    dense = ref.dense_support(spec)
    gen = generator("blocks", family)
    q, k = torch.randn(2, 2, 13, 4, generator=gen), torch.randn(2, 2, 13, 4, generator=gen)
    kwargs = {"mask": to_support(spec), "memory_budget": memory_budget, "scale": 0.7}
    got = attention_max_logit(q, k, **kwargs)  # type: ignore[arg-type]
    assert_statistic_close(got, ref.max_logit_from_qk(q, k, dense, scale=0.7), 1e-5, 1e-6)
    got = attention_distance(q, k, **kwargs)  # type: ignore[arg-type]
    assert_statistic_close(got, ref.distance_from_qk(q, k, dense, scale=0.7), 0, 1e-5)


def test_max_logit_and_distance_with_an_additive_bias() -> None:
    """An ALiBi-like float mask with -inf padding: the bias is part of every logit."""
    spec = spec_for("causal_pad_right", "b2h3n7")
    dense = ref.dense_support(spec)
    q, k = random_qk("b2h3n7", generator("bias-stats"))
    offsets = torch.arange(7)[None, :] - torch.arange(7)[:, None]
    bias = torch.tensor([0.5, 0.25, 0.125])[:, None, None] * offsets.clamp(max=0).float()
    mask = torch.where(dense, bias, -math.inf)
    want = ref.max_logit_from_qk(q, k, dense, bias=torch.where(dense, bias, 0.0))
    assert_statistic_close(attention_max_logit(q, k, mask=mask), want, 1e-5, 1e-6)
    want = ref.distance_from_qk(q, k, dense, bias=torch.where(dense, bias, 0.0))
    assert_statistic_close(attention_distance(q, k, mask=mask), want, 0, 1e-5)


def large_logit_qk(kind: str, magnitude: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k (float32) whose logits reach ``magnitude``: spread-out (shared key direction) or peaked."""
    gen = generator("large-stats", kind, magnitude)
    q, k = torch.randn(2, 2, 24, 8, generator=gen), torch.randn(2, 1, 24, 8, generator=gen)
    if kind == "shared":
        # Every key shares one large component: logits ~ magnitude, their differences O(1) (spread weights).
        q[..., 0] = math.sqrt(magnitude * math.sqrt(8))
        k[..., 0] = math.sqrt(magnitude * math.sqrt(8))
    else:
        q = q * math.sqrt(magnitude)
        k = k * math.sqrt(magnitude)
    return q, k


@pytest.mark.parametrize("family", ["causal_pad_left", "documents_causal", "none", "one_valid"])
@pytest.mark.parametrize("magnitude", [1e2, 1e3, 1e4])
@pytest.mark.parametrize("kind", ["shared", "peaked"])
def test_max_logit_and_distance_at_large_logits(kind: str, magnitude: float, family: str) -> None:
    q, k = large_logit_qk(kind, magnitude)
    spec = ref.make_spec(family, 2, 2, 24, 24, seed=3)
    dense = ref.dense_support(spec)
    want_max = ref.max_logit_from_qk(q, k, dense)
    assert float(want_max.nan_to_num().abs().max()) > 0.5 * magnitude
    assert_statistic_close(attention_max_logit(q, k, mask=to_support(spec)), want_max, rtol=1e-4)
    want = ref.distance_from_qk(q, k, dense)
    if kind == "shared":
        assert float(want.nan_to_num().max()) > 2.0  # spread: the logits' digits decide the weights
    assert_statistic_close(attention_distance(q, k, mask=to_support(spec)), want, rtol=0, atol=1e-3)


def test_distance_known_answers() -> None:
    q = torch.zeros(1, 1, 5, 4)  # equal logits: uniform over the visible keys
    k = torch.randn(1, 1, 5, 4, generator=generator("known"))
    torch.testing.assert_close(attention_distance(q, k, is_causal=True), torch.arange(5.0)[None, None] / 2)
    window = Support(5, causal=True, window=2)
    torch.testing.assert_close(attention_distance(q, k, mask=window), torch.tensor([[[0.0, 0.5, 0.5, 0.5, 0.5]]]))
    one_key = torch.eye(5, dtype=torch.bool).roll(2, dims=1)  # query i sees only key i + 2 (mod 5)
    torch.testing.assert_close(
        attention_distance(torch.randn(1, 1, 5, 4), k, mask=one_key), torch.tensor([[[2.0, 2.0, 2.0, 3.0, 3.0]]])
    )


def test_distance_needs_self_attention() -> None:
    with pytest.raises(ValueError, match="sequence length"):
        attention_distance(torch.randn(1, 1, 4, 8), torch.randn(1, 1, 5, 8))


def test_max_logit_of_one_visible_key_is_its_logit() -> None:
    q, k = torch.randn(2, 2, 5, 4, generator=generator("one")), torch.randn(2, 2, 5, 4, generator=generator("one-k"))
    mask = torch.eye(5, dtype=torch.bool)
    want = (q * k).sum(-1) * 0.5
    torch.testing.assert_close(attention_max_logit(q, k, mask=mask), want)


class _LargestAllocation(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the largest tensor any operation produced."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for value in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(value, torch.Tensor):
                self.largest = max(self.largest, value.numel())
        return out


@pytest.mark.parametrize("function", [attention_max_logit, attention_distance])
@pytest.mark.parametrize("mask", ["causal", "padding", "window"])
def test_no_full_score_matrix(function, mask: str) -> None:  # type: ignore[no-untyped-def]
    """Query blocks under the memory budget: no tensor near B x H x N x N is ever made."""
    batch, heads, length, dim = 2, 2, 256, 8
    q, k = torch.randn(batch, heads, length, dim), torch.randn(batch, heads, length, dim)
    padding = torch.arange(length)[None, :] < torch.tensor([[length], [100]])
    support = {
        "causal": Support(length, causal=True),
        "padding": Support(length, padding_mask=padding),
        "window": Support(length, causal=True, window=16),
    }[mask]
    with _LargestAllocation() as recorder:
        function(q, k, mask=support, memory_budget=32 * 2**10)
    assert recorder.largest < batch * heads * length * length // 8


# --------------------------------------------------------------------------- histogram_quantile


def piecewise_uniform_quantile(counts: list[float], q: float, low: float, high: float) -> float:
    """Exact quantile of the density that is uniform inside each bin (what binned values stand for)."""
    width = (high - low) / len(counts)
    target, seen = q * math.fsum(counts), 0.0
    for index, count in enumerate(counts):
        if count > 0 and seen + count >= target:
            return low + (index + (target - seen) / count) * width
        seen += count
    raise AssertionError("q beyond the total")


@pytest.mark.parametrize(
    ("counts", "low", "high"),
    [
        pytest.param([5.0] * 10, 0.0, 1.0, id="uniform"),
        pytest.param([0.0, 4.0, 0.0, 0.0], 0.0, 1.0, id="one-bin"),
        pytest.param([1.0, 3.0], 0.0, 2.0, id="two-bins"),
        pytest.param([0.0, 1.0, 2.0, 3.0, 4.0, 0.0, 0.0], -1.0, 2.0, id="triangle-shifted"),
        pytest.param([7.0, 0.0, 0.0, 1.0, 0.0, 2.0], 0.0, math.log(64.0), id="gaps-nats"),
    ],
)
def test_histogram_quantile_interpolates_inside_the_bin(counts: list[float], low: float, high: float) -> None:
    """Known distributions: the quantile of the piecewise-uniform density, not a bin edge."""
    levels = [0.0, 0.05, 0.13, 0.25, 0.37, 0.5, 0.61, 0.75, 0.9, 0.99, 1.0]
    got = [float(histogram_quantile(torch.tensor(counts), q, low=low, high=high)) for q in levels]
    want = [piecewise_uniform_quantile(counts, q, low, high) for q in levels]
    assert got == pytest.approx(want, abs=1e-12)


def test_histogram_quantile_of_uniform_values_is_the_level() -> None:
    counts = torch.full((3, 100), 7.0)  # batched: one quantile per row
    for q in (0.013, 0.25, 0.5, 0.777, 0.999):
        torch.testing.assert_close(histogram_quantile(counts, q), torch.full((3,), q, dtype=torch.float64))


def test_histogram_quantile_inside_one_bin() -> None:
    counts = torch.tensor([0.0, 4.0, 0.0, 0.0])  # all mass in [0.25, 0.5)
    got = [float(histogram_quantile(counts, q)) for q in (0.25, 0.5, 0.75, 1.0)]
    assert got == pytest.approx([0.3125, 0.375, 0.4375, 0.5], abs=1e-12)


# --------------------------------------------------------------------------- the bad-input table

BAD_INPUT_TABLE = Path(__file__).resolve().parents[2] / "docs" / "bad_input.md"


def bad_input_rows() -> list[tuple[str, str, str, str, str]]:
    """(function, bad input, call, error, message start) of each row of docs/bad_input.md."""
    rows = []
    for line in BAD_INPUT_TABLE.read_text().splitlines():
        if line.startswith("| `"):
            cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
            assert len(cells) == 5, line
            function, what, call, error, message = cells
            rows.append((function.strip("`"), what, call.strip("`"), error.strip("`"), message))
    return rows


def poke(tensor: torch.Tensor, value: float) -> torch.Tensor:
    """A copy of ``tensor`` with one entry set to ``value``."""
    tensor = tensor.clone()
    tensor.view(-1)[tensor.numel() // 2] = value
    return tensor


@pytest.mark.parametrize(("function", "what", "call", "error", "message"), bad_input_rows(), ids=lambda v: v)
def test_bad_input_table(function: str, what: str, call: str, error: str, message: str) -> None:
    """Each row of the table raises the error it shows, with a message starting as shown."""
    gen = generator("bad-input-table")
    namespace = {name: getattr(functional, name) for name in functional.__all__}
    namespace.update(
        torch=torch,
        Support=Support,
        nan=math.nan,
        inf=math.inf,
        poke=poke,
        q=torch.randn(2, 4, 6, 8, generator=gen),
        k=torch.randn(2, 2, 6, 8, generator=gen),
        attn=torch.full((2, 3, 4, 5), 0.2),
        scores=torch.zeros(2, 3, 4, 5),
    )
    assert call.startswith(f"{function}(")
    with pytest.raises(Exception) as raised:
        eval(call, namespace)
    assert type(raised.value).__name__ == error
    assert str(raised.value).startswith(message), (str(raised.value), message)


def test_bad_input_table_covers_the_functional_api() -> None:
    assert {row[0] for row in bad_input_rows()} == set(functional.__all__)


def test_max_logit_near_zero_after_cancellation_keeps_relative_precision() -> None:
    """Logits of 0.5 made of products of order 1e4: float32 sums lose them, the result must not."""
    gen = generator("cancel")
    q = 100.0 * torch.randn(2, 2, 16, 8, generator=gen, dtype=torch.float64)
    k = 100.0 * torch.randn(2, 2, 16, 8, generator=gen, dtype=torch.float64)
    # The last component of each key makes q_i . k_i / sqrt(8) = 0.5 exactly (before rounding to float32).
    rest = (q[..., :-1] * k[..., :-1]).sum(-1)
    k[..., -1] = (0.5 * math.sqrt(8) - rest) / q[..., -1]
    q, k = q.float(), k.float()
    own_key = torch.eye(16, dtype=torch.bool)
    want = ref.max_logit_from_qk(q, k, own_key)
    assert float(want.abs().max()) < 1.0 and float((q.double() * k.double()).abs().amax()) > 1e3
    assert_statistic_close(attention_max_logit(q, k, mask=own_key), want, rtol=1e-4)


@pytest.mark.parametrize("fn", ["max_logit", "distance"])
def test_query_independent_bias_over_several_query_blocks(fn: str) -> None:
    """A (1, 1, 1, N) additive bias (the same for every query) read correctly in every query block."""
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 2, 8, 4, generator=gen), torch.randn(2, 2, 8, 4, generator=gen)
    bias = torch.randn(1, 1, 1, 8, generator=gen)
    scores = (q.double() @ k.double().transpose(-1, -2)) / 2.0 + bias.double()  # scale 1/sqrt(4)
    if fn == "max_logit":
        want = scores.amax(-1)
        got = attention_max_logit(q, k, mask=bias, memory_budget=200)  # a few queries per block
    else:
        positions = torch.arange(8, dtype=torch.float64)
        want = (scores.softmax(-1) * (positions[:, None] - positions[None, :]).abs()).sum(-1)
        got = attention_distance(q, k, mask=bias, memory_budget=200)
    assert torch.allclose(got.double(), want, atol=1e-4, rtol=1e-4)
