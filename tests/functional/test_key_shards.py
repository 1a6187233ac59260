"""Merging per-query statistics across key shards equals attention over every key at once.

The keys of one call are split into simulated shards (contiguous, uneven,
ring-attention's load-balanced zigzag, one key alone); each shard's
statistics come from :func:`key_shard_statistics` on its keys and mask
columns, and :func:`merge_key_shards` combines them. The reference is the
unsplit float64 dense softmax of ``tests/reference.py``. Broken variants
these tests were seen to catch: shard weights ``exp(lse_r)`` not divided by
the total, an empty shard's NaN mean left in the sum, the maximum of the
first shard only, counts not summed.
"""

from __future__ import annotations

import math

import pytest
import torch

from attn_monitor.functional.shards import KeyShardStatistics, key_shard_statistics, merge_key_shards
from tests.helpers import reference

TOLERANCE = 1e-6
SIZES = (2, 3, 7, 9)  # batch, heads, queries, keys
#: name -> key positions of each shard, for 9 keys.
SPLITS = {
    "halves": [list(range(0, 4)), list(range(4, 9))],
    "uneven": [[0], list(range(1, 3)), list(range(3, 9))],
    # Ring attention's load balancing: shard r holds chunks r and 2R - 1 - r.
    "zigzag": [[0, 1, 8], [2, 3, 7], [4, 5, 6]],
    "one_key_each": [[j] for j in range(9)],
}
FAMILIES = ("none", "causal", "causal_pad_left", "pad_right", "documents_causal", "window", "one_valid", "fully_masked")


def _inputs(family: str, seed: int, offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k with spread logits (plus ``offset^2 / sqrt(8)`` shared by every key of a query) and the support."""
    batch, heads, num_q, num_k = SIZES
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, num_q, 8, generator=generator, dtype=torch.float64) * 2
    k = torch.randn(batch, heads, num_k, 8, generator=generator, dtype=torch.float64) * 2
    q[..., 0], k[..., 0] = offset, offset
    spec = reference.make_spec(family, batch, heads, num_q, num_k, seed)
    return q, k, reference.dense_support(spec)


def _merged(q: torch.Tensor, k: torch.Tensor, visible: torch.Tensor, split: list[list[int]]) -> KeyShardStatistics:
    shards = [key_shard_statistics(q, k[:, :, keys], mask=visible[..., keys]) for keys in split]
    return merge_key_shards(shards)


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert torch.equal(actual.isnan(), expected.isnan())
    torch.testing.assert_close(actual, expected, atol=TOLERANCE, rtol=0, equal_nan=True)


@pytest.mark.parametrize("split", list(SPLITS), ids=list(SPLITS))
@pytest.mark.parametrize("family", FAMILIES, ids=FAMILIES)
@pytest.mark.parametrize("offset", [0.0, 100.0], ids=["spread", "large_logits"])
def test_merge_equals_unsplit_reference(family: str, split: str, offset: float) -> None:
    q, k, visible = _inputs(family, seed=len(family), offset=offset)
    merged = _merged(q, k, visible, SPLITS[split])
    entropy = reference.entropy_from_qk(q, k, visible)
    counts = reference.num_valid(visible)
    many = counts > 1
    if family not in ("one_valid", "fully_masked"):
        assert entropy[many].std() > 0.1, "the reference must be spread, or the test proves little"
    if offset > 0:
        assert reference.max_logit_from_qk(q, k, visible).nan_to_num(1e9).min() > 3000
    _close(merged.entropy, entropy)
    _close(merged.lse, reference.lse_from_qk(q, k, visible))
    _close(merged.max_logit, reference.max_logit_from_qk(q, k, visible))
    assert torch.equal(merged.num_valid, counts)


def test_the_masks_reach_every_case() -> None:
    """The cases the merge must handle occur above: a shard with no visible key for a query that has
    others, queries with one key, queries with none."""

    def cases(family: str) -> tuple[torch.Tensor, torch.Tensor]:
        _, _, visible = _inputs(family, seed=len(family))
        per_shard = torch.stack([visible[..., keys].sum(-1) for keys in SPLITS["halves"]])
        return per_shard, per_shard.sum(0)

    per_shard, total = cases("causal")
    assert ((per_shard == 0) & (total > 0)).any()
    assert (cases("one_valid")[1] == 1).all()
    assert (cases("fully_masked")[1] == 0).any()


def test_merging_is_associative() -> None:
    q, k, visible = _inputs("causal_pad_left", seed=3)
    split = SPLITS["uneven"]
    shards = [key_shard_statistics(q, k[:, :, keys], mask=visible[..., keys]) for keys in split]
    nested = merge_key_shards([merge_key_shards(shards[:2]), shards[2]])
    flat = merge_key_shards(shards)
    for nested_value, flat_value in zip(nested, flat, strict=True):
        torch.testing.assert_close(nested_value, flat_value, atol=1e-12, rtol=0, equal_nan=True)


def test_float32_shards_stay_close() -> None:
    q, k, visible = _inputs("causal", seed=5)
    merged = _merged(q.float(), k.float(), visible, SPLITS["zigzag"])
    assert merged.entropy.dtype == torch.float32
    torch.testing.assert_close(
        merged.entropy.double(), reference.entropy_from_qk(q, k, visible), atol=1e-5, rtol=0, equal_nan=True
    )


def test_one_shard_is_the_unsplit_call() -> None:
    q, k, visible = _inputs("window", seed=2)
    whole = key_shard_statistics(q, k, mask=visible)
    merged = merge_key_shards([whole])
    _close(merged.entropy, reference.entropy_from_qk(q, k, visible))
    assert math.isinf(float(merged.lse.min())) is False


def test_bad_shards_are_refused() -> None:
    with pytest.raises(TypeError, match="non-empty sequence of KeyShardStatistics"):
        merge_key_shards([])
    with pytest.raises(TypeError, match="KeyShardStatistics"):
        merge_key_shards([(torch.zeros(1),) * 4])  # type: ignore[list-item]
