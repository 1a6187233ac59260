"""The fused kernel path: precision at large logits, structured masks, no N x N tensors, the CUDA branch.

Every entropy is checked against the float64 dense reference of
``tests/reference.py``; the structure tests look at what the kernel is given
(shapes, strides, sizes of every tensor produced during a call) through a
``TorchDispatchMode``, never at timings. The CUDA branch runs here on the
``meta`` device: the same code, shapes and allocations, no GPU.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import attn_monitor.functional.entropy as functional
import attn_monitor.functional.kernels as kernels
import tests.helpers.reference as ref
from attn_monitor import Support, entropy_from_qk

TOL = 1e-4  # nats, against float64, at any logit size
LARGE_FAMILIES = ["none", "causal_pad_left", "pad_right", "documents_pad", "window_pad_causal", "explicit_pad"]


def spec_of(family: str, batch: int = 2, heads: int = 2, length: int = 24, seed: int = 0) -> ref.MaskSpec:
    return ref.make_spec(family, batch, heads, length, length, seed)


def support_of(spec: ref.MaskSpec) -> Support:
    return Support(
        spec.num_queries,
        spec.num_keys,
        padding_mask=None if spec.padding is None else torch.tensor(spec.padding),
        causal=spec.causal,
        window=spec.window,
        document_ids=None if spec.documents is None else torch.tensor(spec.documents),
        mask=spec.explicit,
    )


def large_qk(spec: ref.MaskSpec, size: float, kind: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k whose logits reach ``size``.

    ``shared``: keys and queries share one large direction, so every logit is
    ~``size`` and the softmax stays spread over a few nats (the cancellation
    case). ``spread``: independent large vectors, logits of either sign up to
    ~``size``, nearly one-hot rows.
    """
    gen = torch.Generator().manual_seed(seed)
    dim = 16
    shape_q = (spec.batch, spec.heads, spec.num_queries, dim)
    shape_k = (spec.batch, spec.heads, spec.num_keys, dim)
    if kind == "shared":
        direction = torch.randn(dim, generator=gen)
        direction = direction / direction.norm()
        amplitude = math.sqrt(size * math.sqrt(dim))
        # Keys differ by O(1) in logit: each query spreads its mass over many of them.
        q = torch.randn(shape_q, generator=gen) * 0.5 + direction * amplitude
        k = torch.randn(shape_k, generator=gen) * (3.0 / amplitude) + direction * amplitude
        return q, k
    q = torch.randn(shape_q, generator=gen)
    k = torch.randn(shape_k, generator=gen) * size / 3 / dim**0.25
    return q, k


@pytest.mark.parametrize("method", ["fused", "chunked"])
@pytest.mark.parametrize("family", LARGE_FAMILIES)
@pytest.mark.parametrize("size", [1e3, 1e4])
@pytest.mark.parametrize("kind", ["shared", "spread"])
def test_large_logits_match_float64(kind: str, size: float, family: str, method: str) -> None:
    spec = spec_of(family)
    q, k = large_qk(spec, size, kind)
    support = ref.dense_support(spec)
    want = ref.entropy_from_qk(q, k, support)
    scores = ref.scores_from_qk(q, k).masked_fill(~support, 0.0)
    assert scores.abs().max() > size / 3  # the logits really are large
    if kind == "shared":  # a spread reference: the cancellation case, not one-hot rows
        assert want[~torch.isnan(want)].mean() > 0.5
    got = entropy_from_qk(q, k, mask=support_of(spec), method=method)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    error = (got.double() - want).abs().nan_to_num(0.0).max()
    assert error <= TOL, f"{error:.2e} nats off float64"


def test_large_logit_bound_separates_the_float64_pass() -> None:
    # Just under the bound the float32 identity is already within tolerance.
    spec = spec_of("causal_pad_left")
    q, k = large_qk(spec, functional.LARGE_LOGIT * 0.9, "shared")
    want = ref.entropy_from_qk(q, k, ref.dense_support(spec))
    got = entropy_from_qk(q, k, mask=support_of(spec), method="fused")
    assert (got.double() - want).abs().nan_to_num(0.0).max() <= TOL


# --------------------------------------------------------------------------- structured masks


def additive(visible: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros(visible.shape, dtype=dtype).masked_fill(~visible, torch.finfo(dtype).min)


STRUCTURED = {
    # family -> what the recognised support must hold instead of a dense mask
    "causal_pad_left": "padding_mask",
    "causal_pad_right": "padding_mask",
    "pad_right": "padding_mask",
    "window_pad_causal": "window",
    "documents": "document_ids",
    "documents_pad": "document_ids",
    "documents_causal": "document_ids",
}


@pytest.mark.parametrize("form", ["bool", "additive"])
@pytest.mark.parametrize("family", list(STRUCTURED))
def test_dense_model_masks_are_recognised(family: str, form: str) -> None:
    spec = spec_of(family, heads=1)
    dense = ref.dense_support(spec)  # (B, 1, N, N) as models pass it
    mask = dense if form == "bool" else additive(dense)
    support = Support.from_sdpa(spec.num_queries, spec.num_keys, mask, False)
    assert support.mask is None, support
    assert getattr(support, STRUCTURED[family]) is not None, support
    assert support.causal == spec.causal
    assert torch.equal(torch.broadcast_to(support.dense(), dense.shape), dense)
    assert torch.equal(support.num_valid().expand(dense.shape[:3]), ref.num_valid(dense))


def test_dense_mask_with_other_pattern_stays_dense() -> None:
    spec = spec_of("explicit_causal", heads=1)
    dense = ref.dense_support(spec)
    support = Support.from_sdpa(spec.num_queries, spec.num_keys, dense, False)
    assert support.mask is not None
    biased = additive(dense).masked_fill(dense, 0.5)  # a bias: not only a support
    assert Support.from_sdpa(spec.num_queries, spec.num_keys, biased, False).bias is not None


def test_key_masks_stay_key_masks() -> None:
    padding = torch.tensor([[True] * 5 + [False] * 3, [True] * 8])
    for mask in (
        padding[:, None, None, :],
        additive(padding[:, None, None, :]),
        padding[:, None, None, :].expand(2, 1, 8, 8),
    ):
        support = Support(8, mask=mask)
        assert support.mask is None and support.padding_mask is not None
        assert support.query_mask is None  # a key mask says nothing about which queries count
        assert support.num_valid().expand(2, 1, 8).tolist() == [[[5] * 8], [[8] * 8]]


@pytest.mark.parametrize("form", ["bool", "additive", "support"])
@pytest.mark.parametrize("family", ["window_pad_causal", "documents_pad", "documents_causal", "causal_pad_left"])
def test_blocked_kernel_calls_match_reference(family: str, form: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Blocks of 8 queries over 40: several kernel calls, hidden key blocks skipped.
    monkeypatch.setattr(kernels, "QUERY_BLOCK", 8)
    spec = spec_of(family, heads=1, length=40, seed=3)
    spec.heads = 3
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 3, 40, 16, generator=gen), torch.randn(2, 3, 40, 16, generator=gen)
    dense = ref.dense_support(spec)
    mask: Any = {"bool": dense[:, :1], "additive": additive(dense[:, :1]), "support": support_of(spec)}[form]
    got = entropy_from_qk(q, k, mask=mask, method="fused")
    want = ref.entropy_from_qk(q, k, dense)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert (got.double() - want).abs().nan_to_num(0.0).max() <= 1e-5


def test_window_calls_skip_hidden_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "QUERY_BLOCK", 16)
    calls = kernels._kernel_calls(Support(128, causal=True, window=8), torch.float32)
    assert len(calls) == 8
    assert all(k_stop - k_start <= 16 + 7 for _, _, k_start, k_stop, _, _ in calls)


# --------------------------------------------------------------------------- no N x N tensor


class SizeWatch(TorchDispatchMode):
    """Records the largest number of elements of any tensor produced (or handed to a kernel)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0
        self.calls: list[tuple[Any, tuple, dict]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.calls.append((func, args, kwargs))
        for value in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(value, torch.Tensor):
                self.largest = max(self.largest, value.untyped_storage().nbytes() // max(1, value.element_size()))
        return out


N, BATCH, HEADS, DIM = 1024, 2, 2, 8  # B H N D = 32k elements, N x N = 1M
PADDING = torch.arange(N)[None, :] < torch.tensor([[N], [N // 3]])


def structured_masks() -> dict[str, dict[str, Any]]:
    return {
        "key-padding-bool": {"mask": PADDING[:, None, None, :]},
        "key-padding-additive": {"mask": additive(PADDING[:, None, None, :])},
        "causal+padding": {"mask": Support(N, padding_mask=PADDING, causal=True)},
        "window": {"mask": Support(N, causal=True, window=64)},
        "window+padding": {"mask": Support(N, padding_mask=PADDING, causal=True, window=64)},
        "causal-flag": {"is_causal": True},
    }


@pytest.mark.parametrize("name", list(structured_masks()))
@pytest.mark.parametrize("method", ["fused", "auto"])
def test_no_n_by_n_tensor_for_structured_supports(name: str, method: str) -> None:
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(BATCH, HEADS, N, DIM, generator=gen), torch.randn(BATCH, HEADS, N, DIM, generator=gen)
    with SizeWatch() as watch:
        entropy = entropy_from_qk(q, k, method=method, **structured_masks()[name])
    assert watch.largest < N * N // 4, f"a tensor of {watch.largest} elements (N x N = {N * N})"
    assert not torch.isnan(entropy[0]).any()


# --------------------------------------------------------------------------- the CUDA branch, on meta


@contextmanager
def on_meta(support: Support) -> Iterator[Support]:
    """The support with every tensor moved to the meta device (shapes only)."""
    meta = Support.__new__(Support)
    meta.__dict__.update(
        {key: value.to("meta") if isinstance(value, torch.Tensor) else value for key, value in support.__dict__.items()}
    )
    yield meta


BIG = dict(batch=8, heads=32, length=4096, dim=64)  # a padded batch the old branch blew up to 17 GB for


@pytest.mark.parametrize(
    "name",
    ["padding", "causal+padding", "window+padding", "padding-gqa", "causal-gqa", "dense-mask"],
)
def test_cuda_branch_passes_masks_as_broadcast_views(name: str) -> None:
    batch, heads, length, dim = BIG["batch"], BIG["heads"], BIG["length"], BIG["dim"]
    kv_heads = 8 if name.endswith("gqa") else heads
    padding = torch.arange(length)[None, :] < torch.randint(length // 2, length, (batch, 1))
    supports = {
        "padding": Support(length, mask=padding[:, None, None, :]),
        "causal+padding": Support(length, padding_mask=padding, causal=True),
        "window+padding": Support(length, padding_mask=padding, causal=True, window=512),
        "padding-gqa": Support(length, mask=padding[:, None, None, :]),
        "causal-gqa": Support(length, causal=True),
        "dense-mask": Support(length, mask=torch.rand(1, 1, length, length) < 0.5),  # the mask itself is N x N
    }
    q = torch.empty(batch, heads, length, dim, device="meta")
    k = torch.empty(batch, kv_heads, length, dim, device="meta")
    with on_meta(supports[name]) as support, SizeWatch() as watch:
        out, lse = kernels._run_kernel(kernels._cuda_attention, q, k, support, 0.1)
    assert out.shape == q.shape and lse.shape == q.shape[:3]
    kernel_calls = [c for c in watch.calls if c[0] is torch.ops.aten._scaled_dot_product_efficient_attention.default]
    assert kernel_calls
    per_head_n2 = batch * heads * length * length
    assert watch.largest < per_head_n2 // heads  # nothing O(B H N^2); only the dense mask itself is N x N
    if name != "dense-mask":
        assert watch.largest <= batch * heads * length * dim  # O(B H N D): outputs, repeated keys at most
    for _, args, _ in kernel_calls:
        bias = args[3]
        if bias is not None:
            assert bias.untyped_storage().nbytes() < per_head_n2 * 4 // heads  # a view, not an expansion
            assert bias.stride(-1) == 1 and bias.stride(-2) % 16 == 0
    if name == "padding-gqa":  # keys are not copied: folded query groups share them
        assert all(args[1].shape[1] == kv_heads for _, args, _ in kernel_calls)


def test_cuda_branch_folded_groups_match_repeated_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    # The folding itself, checked on CPU with the math kernel standing in for the CUDA one.
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 6, 10, 8, generator=gen), torch.randn(2, 2, 10, 8, generator=gen)
    mask = additive(torch.arange(10)[None, None, None, :] < torch.tensor([10, 4])[:, None, None, None])

    def efficient(q_: torch.Tensor, k_: torch.Tensor, _v: torch.Tensor, bias: Any, *args: Any, **kwargs: Any) -> Any:
        scores = q_ @ k_.transpose(-1, -2) * kwargs["scale"] + (0 if bias is None else bias)
        lse = scores.logsumexp(-1)
        padded = torch.nn.functional.pad(lse, (0, (-lse.shape[-1]) % 32))
        return scores.softmax(-1) @ k_, padded, None, None

    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_efficient_attention", efficient)
    out, lse = kernels._cuda_attention(q, k, mask, False, 0.3)
    scores = q @ k.repeat_interleave(3, 1).transpose(-1, -2) * 0.3 + mask
    assert torch.allclose(lse, scores.logsumexp(-1), atol=1e-5)
    assert torch.allclose(out, scores.softmax(-1) @ k.repeat_interleave(3, 1), atol=1e-5)


def test_recognition_is_reused_only_for_the_unchanged_mask() -> None:
    spec = spec_of("causal_pad_right", heads=1)
    dense = ref.dense_support(spec)
    first = Support.from_sdpa(spec.num_queries, spec.num_keys, dense, False)
    again = Support.from_sdpa(spec.num_queries, spec.num_keys, dense, False)  # the next layer, same tensor
    assert torch.equal(again.num_valid(), first.num_valid())
    dense[0, 0, 5, 2] = False  # changed in place: a hole, no longer causal + padding
    changed = Support.from_sdpa(spec.num_queries, spec.num_keys, dense, False)
    assert changed.mask is not None
    assert torch.equal(changed.num_valid().expand(dense.shape[:3]), ref.num_valid(dense))


@pytest.mark.parametrize("family", ["window_pad_causal", "documents_pad"])
def test_blocked_calls_at_large_logits(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "QUERY_BLOCK", 8)
    spec = spec_of(family, length=40, seed=5)
    q, k = large_qk(spec, 1e4, "shared")
    want = ref.entropy_from_qk(q, k, ref.dense_support(spec))
    assert want[~torch.isnan(want)].mean() > 0.5
    got = entropy_from_qk(q, k, mask=support_of(spec), method="fused")
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert (got.double() - want).abs().nan_to_num(0.0).max() <= TOL


def test_recognition_follows_the_storage_through_detach() -> None:
    spec = spec_of("causal_pad_right", heads=1)
    dense = ref.dense_support(spec)
    Support.from_sdpa(spec.num_queries, spec.num_keys, dense.detach(), False)
    view = dense.detach()  # the next layer's call: another tensor object, same storage
    view[1, 0, 3, 1] = False  # and now modified in place through the view
    changed = Support.from_sdpa(spec.num_queries, spec.num_keys, dense.detach(), False)
    assert changed.mask is not None
    assert torch.equal(changed.num_valid().expand(dense.shape[:3]), ref.num_valid(dense))


@pytest.mark.parametrize("key_mask", [False, True], ids=["window-padding", "key-mask"])
def test_recognition_runs_once_for_a_mask_every_layer_gets(key_mask: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    import attn_monitor.functional.masks as masks

    calls = []
    real = masks._recognise
    monkeypatch.setattr(masks, "_recognise", lambda *args: calls.append(1) or real(*args))
    spec = spec_of("pad_right" if key_mask else "window_pad_causal", heads=1, seed=11)
    dense = ref.dense_support(spec)
    if key_mask:  # (B, 1, 1, N), as models pass key padding to SDPA
        dense = dense[:, :, :1]
    supports = [Support.from_sdpa(spec.num_queries, spec.num_keys, dense.detach(), False) for _ in range(4)]
    assert len(calls) == 1
    # One support for every layer: its counts are computed once.
    assert all(s is supports[0] for s in supports)
    assert supports[0].mask is None and supports[0].padding_mask is not None
    assert supports[0].padding_mask.untyped_storage().data_ptr() != dense.untyped_storage().data_ptr()
    want = ref.num_valid(ref.dense_support(spec))
    assert torch.equal(supports[0].num_valid().expand(want.shape), want)


def test_recognition_under_inference_mode_sees_in_place_edits() -> None:
    """Lightning validates under torch.inference_mode, whose tensors keep no version counter."""
    spec = spec_of("causal_pad_right", heads=1)
    with torch.inference_mode():
        dense = ref.dense_support(spec).clone()
        first = Support.from_sdpa(spec.num_queries, spec.num_keys, dense, False)
        assert first.mask is None and torch.equal(first.num_valid().expand(dense.shape[:3]), ref.num_valid(dense))
        dense[0, 0, 5, 2] = False  # edited in place: nothing tells a cache so
        changed = Support.from_sdpa(spec.num_queries, spec.num_keys, dense, False)
        assert changed.mask is not None
        assert torch.equal(changed.num_valid().expand(dense.shape[:3]), ref.num_valid(dense))
