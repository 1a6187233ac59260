"""Support (attn_monitor.functional.masks) against the dense loop-built reference."""

from __future__ import annotations

import math
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attn_monitor.functional.masks import Support
from tests.helpers import reference as ref

SHAPES = {
    "b1h1n1": (1, 1, 1, 1),
    "b2h3n7": (2, 3, 7, 7),
    "b2h2q4k9": (2, 2, 4, 9),
    "b1h2q9k4": (1, 2, 9, 4),
    "b3h1n12": (3, 1, 12, 12),
}

CASES = [
    pytest.param(family, shape, id=f"{family}-{shape}")
    for family, needs_square in ref.FAMILIES.items()
    for shape, (_, _, num_q, num_k) in SHAPES.items()
    if num_q == num_k or not needs_square
]


def seed_of(*parts: object) -> int:
    return zlib.crc32("/".join(map(str, parts)).encode())


def make(family: str, shape: str) -> ref.MaskSpec:
    return ref.make_spec(family, *SHAPES[shape], seed=seed_of(family, shape))


def to_support(spec: ref.MaskSpec, *, integer_padding: bool = False) -> Support:
    padding = None
    if spec.padding is not None:
        padding = torch.tensor(spec.padding, dtype=torch.long if integer_padding else torch.bool)
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


def full_shape(spec: ref.MaskSpec) -> tuple[int, int, int, int]:
    return (spec.batch, spec.heads, spec.num_queries, spec.num_keys)


def over_all_queries(mask: torch.Tensor | None, spec: ref.MaskSpec) -> torch.Tensor | None:
    """Expand a (B, H, 1, Nk) key mask over the queries (see test_key_only_mask_*)."""
    if mask is None:
        return None
    return mask.expand(*mask.shape[:2], spec.num_queries, spec.num_keys)


def check_against_reference(spec: ref.MaskSpec, support: Support) -> None:
    dense = ref.dense_support(spec)
    counts = support.num_valid()
    assert counts.dtype == torch.long
    assert counts.dim() == 3
    assert torch.equal(torch.broadcast_to(counts, full_shape(spec)[:3]), ref.num_valid(dense))
    sample = support.is_sample()
    assert sample.dtype == torch.bool
    assert torch.equal(torch.broadcast_to(sample, full_shape(spec)[:3]), ref.is_sample(spec))
    got = support.dense()
    assert got.dtype == torch.bool and got.dim() == 4
    assert torch.equal(torch.broadcast_to(got, full_shape(spec)), dense)


# --------------------------------------------------------------------------- every family x shape


@pytest.mark.parametrize(("family", "shape"), CASES)
def test_support_matches_reference(family: str, shape: str) -> None:
    spec = make(family, shape)
    check_against_reference(spec, to_support(spec))


@pytest.mark.parametrize(("family", "shape"), CASES)
def test_integer_padding_mask_equals_bool(family: str, shape: str) -> None:
    spec = make(family, shape)
    check_against_reference(spec, to_support(spec, integer_padding=True))


@pytest.mark.parametrize(("family", "shape"), CASES)
def test_block_equals_dense_slices(family: str, shape: str) -> None:
    spec = make(family, shape)
    support, dense = to_support(spec), ref.dense_support(spec)
    num_q, num_k = spec.num_queries, spec.num_keys
    for size_q, size_k in ((1, 1), (2, 3), (3, 2), (num_q, num_k)):
        for q_start in range(0, num_q, size_q):
            for k_start in range(0, num_k, size_k):
                q_stop, k_stop = min(num_q, q_start + size_q), min(num_k, k_start + size_k)
                want = dense[:, :, q_start:q_stop, k_start:k_stop]
                got = support.block(q_start, q_stop, k_start, k_stop)
                if got is None:
                    assert bool(want.all()), (q_start, q_stop, k_start, k_stop)
                else:
                    assert torch.equal(torch.broadcast_to(got, want.shape), want), (q_start, q_stop, k_start, k_stop)


@pytest.mark.parametrize(("family", "shape"), CASES)
def test_key_range_never_cuts_visible_keys(family: str, shape: str) -> None:
    spec = make(family, shape)
    support, dense = to_support(spec), ref.dense_support(spec)
    for size in (1, 2, 5, spec.num_queries):
        for q_start in range(0, spec.num_queries, size):
            q_stop = min(spec.num_queries, q_start + size)
            k_start, k_stop = support.key_range(q_start, q_stop)
            assert 0 <= k_start <= k_stop
            # An empty range may sit past the last key (window with Nq > Nk); a non-empty one may not.
            assert k_start == k_stop or k_stop <= spec.num_keys
            rows = dense[:, :, q_start:q_stop]
            assert not rows[..., :k_start].any()
            assert not rows[..., k_stop:].any()


ROUND_TRIP_CASES = [
    pytest.param(family, shape, dtype, id=f"{family}-{shape}-{str(dtype)[6:]}")
    for family, shape in (case.values for case in CASES)
    for dtype in (torch.float32, torch.float16, torch.bfloat16)
    if dtype == torch.float32 or shape == "b2h3n7"
]


@pytest.mark.parametrize(("family", "shape", "dtype"), ROUND_TRIP_CASES)
def test_additive_mask_round_trip(family: str, shape: str, dtype: torch.dtype) -> None:
    spec = make(family, shape)
    dense = ref.dense_support(spec)
    additive, is_causal = to_support(spec).additive_mask(dtype)
    if additive is None:
        assert bool(dense.all()) or (is_causal and spec.causal)
    else:
        assert additive.dtype == dtype and additive.dim() == 4
        assert bool(((additive == 0) | (additive == -math.inf)).all())
    rebuilt = Support(spec.num_queries, spec.num_keys, causal=is_causal, mask=over_all_queries(additive, spec))
    assert rebuilt.bias is None
    assert torch.equal(torch.broadcast_to(rebuilt.dense(), full_shape(spec)), dense)
    assert torch.equal(torch.broadcast_to(rebuilt.num_valid(), full_shape(spec)[:3]), ref.num_valid(dense))


# --------------------------------------------------------------------------- random combinations


@st.composite
def mask_specs(draw: st.DrawFn) -> ref.MaskSpec:
    batch = draw(st.integers(1, 3))
    heads = draw(st.integers(1, 3))
    num_q = draw(st.integers(1, 9))
    num_k = draw(st.one_of(st.just(num_q), st.integers(1, 9)))
    spec = ref.MaskSpec(batch, heads, num_q, num_k)
    if draw(st.booleans()):
        # Any pattern, holes in the middle included.
        spec.padding = draw(
            st.lists(st.lists(st.booleans(), min_size=num_k, max_size=num_k), min_size=batch, max_size=batch)
        )
    spec.causal = draw(st.booleans())
    if spec.causal and draw(st.booleans()):
        spec.window = draw(st.integers(1, 10))
    if num_q == num_k and draw(st.booleans()):
        rows = []
        for _ in range(batch):
            runs = draw(st.lists(st.integers(1, num_k), min_size=1, max_size=num_k))
            labels = draw(st.permutations(range(len(runs))))
            ids = [label * 3 - 7 for label, run in zip(labels, runs, strict=True) for _ in range(run)]
            rows.append((ids + [ids[-1]] * num_k)[:num_k])
        spec.documents = rows
    if draw(st.booleans()):
        mask_batch = draw(st.sampled_from([1, batch]))
        mask_heads = draw(st.sampled_from([1, heads]))
        seed = draw(st.integers(0, 2**31 - 1))
        gen = torch.Generator().manual_seed(seed)
        spec.explicit = torch.rand(mask_batch, mask_heads, num_q, num_k, generator=gen) < 0.6
    return spec


@settings(max_examples=100, deadline=None)
@given(spec=mask_specs())
def test_random_combinations_match_reference(spec: ref.MaskSpec) -> None:
    check_against_reference(spec, to_support(spec))


@settings(max_examples=60, deadline=None)
@given(spec=mask_specs())
def test_random_combinations_additive_round_trip(spec: ref.MaskSpec) -> None:
    additive, is_causal = to_support(spec).additive_mask(torch.float32)
    rebuilt = Support(spec.num_queries, spec.num_keys, causal=is_causal, mask=over_all_queries(additive, spec))
    assert torch.equal(torch.broadcast_to(rebuilt.dense(), full_shape(spec)), ref.dense_support(spec))


# --------------------------------------------------------------------------- specific behaviour


def test_key_only_mask_broadcasts_over_queries() -> None:
    # (B, 1, 1, Nk) is SDPA's usual key-padding mask and documented as "broadcastable".
    padding = torch.tensor([[True, True, False], [True, False, False]])
    support = Support(3, mask=padding[:, None, None, :])
    assert support.num_valid().tolist() == [[[2, 2, 2]], [[1, 1, 1]]]


def test_key_only_additive_mask_is_accepted_back() -> None:
    support = Support(4, padding_mask=torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]]), causal=True)
    additive, is_causal = support.additive_mask(torch.float32)
    assert additive is not None and additive.shape == (2, 1, 1, 4) and is_causal
    again = Support(4, causal=is_causal, mask=additive)
    assert torch.equal(again.num_valid(), support.num_valid())


def test_padding_and_causal_closed_form_example() -> None:
    # Left padding: the first two queries of row 0 see no key at all.
    padding = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]])
    support = Support(5, padding_mask=padding, causal=True)
    assert support.num_valid().tolist() == [[[0, 0, 1, 2, 3]], [[1, 2, 3, 4, 4]]]
    assert support.is_sample().tolist() == [[[False, False, True, True, True]], [[True, True, True, True, False]]]


def test_window_and_documents_example() -> None:
    support = Support(6, causal=True, window=2, document_ids=torch.tensor([[4, 4, 4, 1, 1, 1]]))
    assert support.num_valid().tolist() == [[[1, 2, 2, 1, 2, 2]]]


def test_query_mask_overrides_padding_queries() -> None:
    padding = torch.tensor([[1, 1, 1, 0]])
    query_mask = torch.tensor([[True, False, True, True]])
    support = Support(4, padding_mask=padding, query_mask=query_mask, causal=True)
    assert support.num_valid().tolist() == [[[1, 2, 3, 3]]]
    assert support.is_sample().tolist() == [[[True, False, True, True]]]


def test_cross_attention_padding_does_not_mark_queries() -> None:
    # Nq != Nk: the key padding says nothing about which queries are real.
    support = Support(3, 5, padding_mask=torch.tensor([[1, 1, 0, 0, 0], [0, 0, 0, 0, 0]]))
    assert support.num_valid().tolist() == [[[2, 2, 2]], [[0, 0, 0]]]
    assert support.is_sample().tolist() == [[[True, True, True]], [[False, False, False]]]


@pytest.mark.parametrize(
    "mask",
    [
        pytest.param(torch.tensor([[True, False, True], [False, False, True]]), id="2d"),
        pytest.param(torch.tensor([[[True, False, True], [False, False, True]]] * 2), id="3d-heads"),
    ],
)
def test_low_rank_explicit_masks_broadcast_as_sdpa(mask: torch.Tensor) -> None:
    support = Support(2, 3, mask=mask)
    assert support.dense().dim() == 4
    assert torch.broadcast_to(support.num_valid(), (1, mask.dim() - 1, 2)).tolist()[0][0] == [2, 1]


def test_per_head_explicit_mask_counts_per_head() -> None:
    mask = torch.zeros(1, 3, 4, 4, dtype=torch.bool)
    for h in range(3):
        mask[0, h, :, : h + 1] = True
    support = Support(4, mask=mask, padding_mask=torch.tensor([[1, 0, 1, 1]]))
    assert support.num_valid().tolist() == [[[1] * 4, [1] * 4, [2] * 4]]
    assert support.is_sample().tolist() == [[[True, False, True, True]] * 3]


def test_additive_bias_is_kept_and_round_trips() -> None:
    slopes = torch.tensor([0.5, 0.25])
    i, j = torch.arange(5)[:, None], torch.arange(5)[None, :]
    bias = -slopes[:, None, None] * (i - j).abs().float()
    alibi = torch.where(j <= i, bias, torch.tensor(-math.inf))[None]  # (1, 2, 5, 5)
    support = Support(5, mask=alibi)
    assert support.bias is not None
    assert torch.equal(torch.broadcast_to(support.dense(), (1, 2, 5, 5)), (j <= i).expand(1, 2, 5, 5))
    additive, is_causal = support.additive_mask(torch.float32)
    assert not is_causal
    assert torch.equal(additive, alibi)
    again = Support(5, mask=additive)
    assert again.bias is not None and torch.equal(torch.where(j <= i, again.bias, 0.0), torch.where(j <= i, alibi, 0.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_dtype_minimum_hides_like_minus_inf(dtype: torch.dtype) -> None:
    visible = torch.tensor([[True, False, True, True], [False, True, True, False]])
    additive = torch.where(visible, torch.tensor(0.0, dtype=dtype), torch.tensor(torch.finfo(dtype).min, dtype=dtype))
    support = Support(2, 4, mask=additive)
    assert support.bias is None
    assert torch.equal(support.dense()[0, 0], visible)
    assert support.num_valid().tolist() == [[[3, 2]]]


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "documents",
    [
        pytest.param([[0, 0, 1, 0]], id="returns"),
        pytest.param([[1, 2, 1, 2]], id="interleaved"),
        pytest.param([[0, 0, 0, 0], [3, 5, 5, 3]], id="second-row"),
    ],
)
def test_documents_not_contiguous(documents: list[list[int]]) -> None:
    with pytest.raises(ValueError, match="contiguous"):
        Support(4, document_ids=torch.tensor(documents))


@pytest.mark.parametrize("window", [1, 3])
def test_window_without_causal(window: int) -> None:
    with pytest.raises(ValueError, match=r"`window`.*causal"):
        Support(4, window=window)


@pytest.mark.parametrize("window", [0, -2, 2.0, True])
def test_window_not_a_positive_int(window: object) -> None:
    with pytest.raises(ValueError, match="`window`"):
        Support(4, causal=True, window=window)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param(
            {"padding_mask": torch.ones(2, 4, dtype=torch.long), "document_ids": torch.zeros(3, 4, dtype=torch.long)},
            id="pad-docs",
        ),
        pytest.param(
            {"padding_mask": torch.ones(2, 4, dtype=torch.bool), "mask": torch.ones(3, 1, 4, 4, dtype=torch.bool)},
            id="pad-mask",
        ),
        pytest.param(
            {"document_ids": torch.zeros(2, 4, dtype=torch.long), "mask": torch.ones(3, 2, 4, 4, dtype=torch.bool)},
            id="docs-mask",
        ),
        pytest.param(
            {"padding_mask": torch.ones(2, 4, dtype=torch.bool), "query_mask": torch.ones(3, 4, dtype=torch.bool)},
            id="pad-query",
        ),
    ],
)
def test_mismatched_batch_sizes(kwargs: dict[str, torch.Tensor]) -> None:
    with pytest.raises(ValueError, match="batch size"):
        Support(4, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        pytest.param(
            {"padding_mask": torch.ones(2, 5, dtype=torch.bool)}, ValueError, "`padding_mask`", id="padding-length"
        ),
        pytest.param(
            {"padding_mask": torch.ones(4, dtype=torch.bool)}, ValueError, "`padding_mask`", id="padding-rank"
        ),
        pytest.param({"padding_mask": torch.ones(2, 4)}, TypeError, "`padding_mask`", id="padding-float"),
        pytest.param({"padding_mask": [[1, 1, 1, 1]]}, TypeError, "`padding_mask`", id="padding-list"),
        pytest.param({"query_mask": torch.ones(2, 3, dtype=torch.bool)}, ValueError, "`query_mask`", id="query-length"),
        pytest.param({"document_ids": torch.zeros(2, 4)}, TypeError, "`document_ids`", id="docs-float"),
        pytest.param(
            {"document_ids": torch.zeros(2, 4, dtype=torch.bool)}, TypeError, "`document_ids`", id="docs-bool"
        ),
        pytest.param(
            {"document_ids": torch.zeros(2, 5, dtype=torch.long)}, ValueError, "`document_ids`", id="docs-length"
        ),
        pytest.param({"mask": torch.ones(1, 1, 4, 5, dtype=torch.bool)}, ValueError, "`mask`", id="mask-keys"),
        pytest.param({"mask": torch.ones(1, 1, 1, 4, 4, dtype=torch.bool)}, ValueError, "`mask`", id="mask-rank5"),
        pytest.param({"mask": torch.ones(4, dtype=torch.bool)}, ValueError, "`mask`", id="mask-rank1"),
        pytest.param({"mask": torch.ones(4, 4, dtype=torch.long)}, TypeError, "`mask`", id="mask-int"),
        pytest.param({"mask": torch.full((4, 4), math.nan)}, ValueError, "`mask`", id="mask-nan"),
        pytest.param({"mask": [[True] * 4] * 4}, TypeError, "`mask`", id="mask-list"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs: dict[str, object], error: type[Exception], name: str) -> None:
    with pytest.raises(error, match=name):
        Support(4, **kwargs)  # type: ignore[arg-type]


def test_documents_need_self_attention() -> None:
    with pytest.raises(ValueError, match="`document_ids`"):
        Support(4, 5, document_ids=torch.zeros(1, 5, dtype=torch.long))


@pytest.mark.parametrize(("num_queries", "num_keys"), [(0, 3), (3, 0), (-1, None), (2.0, None)])
def test_sizes_must_be_positive_ints(num_queries: object, num_keys: object) -> None:
    with pytest.raises(ValueError, match=r"`num_(queries|keys)`"):
        Support(num_queries, num_keys)  # type: ignore[arg-type]
