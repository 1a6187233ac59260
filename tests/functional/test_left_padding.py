"""Left-padded batches told by a (batch, keys) padding mask, as flash kernels receive them.

With causal order, query i of a left-padded row sees the real keys among
positions 0..i, which is ``i + 1 - padding`` keys, not ``min(i + 1, length)``
as a right-padded row of that length would. The reference
(tests/reference.py) builds the support cell by cell and the entropies
with Python floats.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attn_monitor.capture.hf_interface import read_interface_call
from attn_monitor.functional.entropy import entropy_from_qk
from attn_monitor.functional.masks import Support
from tests.helpers import reference

BATCH, HEADS, SEQ, DIM = 4, 2, 9, 8
#: Row 0 unpadded, rows 1 and 2 left-padded by 2 and 5 tokens, row 3 right-padded by 3.
PADDING = [[True] * SEQ, [False] * 2 + [True] * 7, [False] * 5 + [True] * 4, [True] * 6 + [False] * 3]


def _qk() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(4)
    q = torch.randn(BATCH, HEADS, SEQ, DIM, generator=generator) * 2.0  # large logits: spread entropies
    k = torch.randn(BATCH, HEADS, SEQ, DIM, generator=generator) * 2.0
    return q, k


@pytest.mark.parametrize("route", ["support", "interface"])
def test_left_padded_causal_rows_count_only_their_real_earlier_keys(route: str) -> None:
    """Counts, samples and normalised entropies of a causal (batch, keys)-padded batch equal the reference.

    ``interface``: the mask arrives as transformers' ``flash_attention_mask``
    gives it, (batch, keys), at a kernel with no 4-dim mask
    (:func:`read_interface_call`). Fails when the padding is read as right
    padding (the causal count taken as ``min(i + 1, number of real tokens)``
    in ``Support``'s closed form), independently of the Hugging Face model
    tests.
    """
    q, k = _qk()
    padding = torch.tensor(PADDING)
    if route == "support":
        support = Support(SEQ, SEQ, padding_mask=padding, causal=True)
    else:
        _, _, _, support, _ = read_interface_call(nn.Module(), q, k, padding.long(), {})
    spec = reference.MaskSpec(BATCH, HEADS, SEQ, SEQ, padding=PADDING, causal=True)
    dense = reference.dense_support(spec)
    counts = reference.num_valid(dense)
    sample = reference.is_sample(spec)
    assert counts[1, 0].tolist() == [0, 0, 1, 2, 3, 4, 5, 6, 7]  # not min(i + 1, 7)

    assert torch.equal(support.num_valid().expand(BATCH, HEADS, SEQ), counts)
    assert torch.equal(support.is_sample().expand(BATCH, HEADS, SEQ), sample)
    got = entropy_from_qk(q, k, mask=support, scale=1.0, normalize=True)
    want = reference.normalize(reference.entropy_from_qk(q, k, dense, scale=1.0), counts)
    counted = sample & (counts > 1)
    assert float(want[counted].max() - want[counted].min()) > 0.3  # spread: a wrong support moves values
    torch.testing.assert_close(got[counted].double(), want[counted], atol=1e-5, rtol=0)
